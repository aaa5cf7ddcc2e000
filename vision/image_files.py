"""Reading the images of a vision-language dataset: a path, raw bytes, or ``{"bytes", "path"}`` (what the Hugging Face
``datasets`` Image feature and parquet files hold), decoded by PIL and nothing else.

An image is data, never code: only PIL's raster decoders in ``FORMATS`` may open it (not EPS, whose plugin runs
Ghostscript, nor any other format that hands the file to another program), and URLs are refused (a training run
reads local data; download first). Each bad image stops the run in one line naming where it is (``data.jsonl:
record 3: image 1: ...``) and what to do: a missing file, a file that is not an image, an image of zero width or
height, one past ``max_pixels`` (read from the header, before anything is decoded: a 1 KB PNG may claim 20000 x
20000 pixels, 1.2 GB decoded), and PIL's own decompression-bomb error and warning, which become that error. The
image is decoded in full here, so a truncated file is found when the dataset is built, not mid-run.

The result is what the Hugging Face processors see: the EXIF orientation applied when the file has one (as
``datasets`` decodes and ``transformers.image_utils.load_image`` loads), then converted to RGB as their image
processors' ``do_convert_rgb`` does (``transformers.image_transforms.convert_to_rgb``): transparency composited onto
white, not dropped. Except at 16 bits: a 16-bit greyscale image (a PNG's, a TIFF's, a PGM's) is scaled to 8 bits as
the format means it, where transformers' conversion (PIL's) clips every value over 255, so that a mid-grey image is
white there (see :func:`convert_to_rgb`); and a 32-bit one (PIL's mode "I" or "F", a TIFF's), whose values' range
no file says, is refused before it is decoded. (PIL itself reads 16-bit RGB and RGBA PNGs as 8 bits a channel.)
"""

from __future__ import annotations

import io
import re
import struct
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MAX_PIXELS = 2**26  # about 67 M pixels (8192 x 8192): past it an image is refused before it is decoded
# PIL decoders that only decode pixels (no plugin here calls another program).
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM", "TGA", "ICO")
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")  # PIL's 16-bit greyscale (PNG, TIFF)
THIRTY_TWO_BIT_MODES = {"I": "integer", "F": "floating-point"}  # PIL opens a 16-bit PGM as "I" too (0-65535)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def load_image(source, where: str, root: Path | None = None, max_pixels: int = MAX_PIXELS,
               fix: str | None = None) -> Image.Image:
    """The image ``source`` (a path, relative ones under ``root``; raw ``bytes``; or ``{"bytes", "path"}``, the
    bytes preferred when both are there, as ``datasets`` does), decoded and converted to RGB; a ``ValueError``
    of one line naming ``where`` when it cannot be used. ``fix`` is what that line tells the user to do about a file
    that is no usable image (empty, not an image, zero-size, damaged); None: a dataset record's advice (replace the
    image or drop the record)."""
    data, path = _bytes_or_path(source, where, root, fix)
    what = str(path) if path is not None else "the image bytes"
    try:
        opened = open(path, "rb") if path is not None else io.BytesIO(data)
    except OSError as e:
        raise ValueError(f"{where}: cannot read {path} ({e.strerror or e}); check the file's permissions") from None
    with opened as file:
        with warnings.catch_warnings():  # PIL's DecompressionBombWarning is this module's too-large error
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                image = Image.open(file, formats=FORMATS)
            except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                file.seek(0)
                raise _too_large(where, what, _declared_size(file.read(32)), max_pixels) from None
            except UnidentifiedImageError:
                raise _unidentified(where, what, file, fix) from None
            except Exception as e:  # a plugin's own errors on a malformed header (SyntaxError, struct.error, ...)
                raise _unreadable(where, what, e, fix) from None
            with image:
                width, height = image.size
                if width <= 0 or height <= 0:
                    raise _zero_size(where, what, width, height, fix)
                if width * height > max_pixels:
                    raise _too_large(where, what, (width, height), max_pixels)
                sixteen_bit_pgm = image.mode == "I" and image.format == "PPM"  # PIL scales its maxval to 65535
                if image.mode in THIRTY_TWO_BIT_MODES and not sixteen_bit_pgm:
                    raise _thirty_two_bit(where, what, image.mode)
                try:
                    image.load()
                    if sixteen_bit_pgm:
                        image = sixteen_to_eight_bit(image)
                    if image.getexif().get(0x0112) is not None:  # Orientation: upright, as datasets decodes it
                        image = ImageOps.exif_transpose(image)
                    return convert_to_rgb(image)
                except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                    raise _too_large(where, what, (width, height), max_pixels) from None
                except Exception as e:  # truncated or corrupt data: OSError, ValueError, SyntaxError, ...
                    raise _unreadable(where, what, e, fix) from None


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB as ``transformers.image_transforms.convert_to_rgb`` makes it: an image with an alpha band or
    a transparent colour is composited onto white; others are converted by PIL. 16-bit greyscale first becomes 8-bit
    (:func:`sixteen_to_eight_bit`), where transformers' (PIL's ``convert``) clips it, so our pixel values differ
    from its processors' for such images (and only those): a 16-bit mid-grey is white there, mid-grey here. A 32-bit
    image (mode "I" or "F": no range of values is known) is a one-line ``ValueError``."""
    if image.mode in SIXTEEN_BIT_MODES:
        image = sixteen_to_eight_bit(image)
    elif image.mode in THIRTY_TWO_BIT_MODES:
        raise ValueError(f"a 32-bit {THIRTY_TWO_BIT_MODES[image.mode]} image (PIL mode {image.mode!r}): the range of "
                         "its values is unknown; convert it to 8 bits (mode 'L' or 'RGB') first")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def sixteen_to_eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit greyscale image (values 0-65535) as 8-bit greyscale, each value ``v`` as ``round(v * 255 / 65535)``,
    computed exactly in integers (``v / 257`` is never a half, so no rounding rule is needed), which is what 16 bits
    mean: 32768 (mid-grey) -> 128. A transparent grey (a PNG's tRNS) becomes transparent pixels (mode "LA"): two
    16-bit values may share an 8-bit one, so it cannot stay a transparent colour."""
    values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
    grey = Image.fromarray(((2 * values + 257) // 514).astype(np.uint8))  # floor((v + 128.5) / 257)
    transparent = image.info.get("transparency")
    if isinstance(transparent, int):
        alpha = Image.fromarray(np.where(values == transparent, 0, 255).astype(np.uint8))
        return Image.merge("LA", (grey, alpha))
    return grey


def _bytes_or_path(source, where: str, root: Path | None, fix: str | None) -> tuple[bytes | None, Path | None]:
    """``(bytes, None)`` or ``(None, path)`` for ``source``, checked as far as can be without opening it."""
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            source = source["bytes"]
        elif source.get("path") is not None:
            source = source["path"]
        else:
            raise ValueError(f"{where}: an image given as an object needs 'bytes' or 'path', got keys "
                             f"{sorted(source)}")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise ValueError(f"{where}: the image bytes are empty (0 bytes); give the image file's contents")
        return data, None
    if not isinstance(source, str):
        raise ValueError(f"{where}: expected an image path, bytes, or {{\"bytes\", \"path\"}}, got "
                         f"{type(source).__name__}")
    if _URL.match(source) or source.startswith("data:"):
        shown = source if len(source) <= 80 else source[:77] + "..."
        give = "give its path (relative to the data file) or its bytes" if root is not None else "give its path"
        raise ValueError(f"{where}: {shown!r} is a URL; images are read from local files only: download it and {give}")
    if not source.strip():
        raise ValueError(f"{where}: the image path is empty")
    path = Path(source).expanduser()
    if not path.is_absolute() and root is not None:
        path = Path(root) / path
    if not path.exists():
        hint = " (relative paths are read from the data file's folder)" if root is not None else ""
        raise ValueError(f"{where}: image file not found: {path}{hint}")
    if not path.is_file():
        raise ValueError(f"{where}: {path} is not a file; give an image file")
    if path.stat().st_size == 0:
        raise ValueError(f"{where}: {path} is empty (0 bytes); {fix or 'replace it with the image or drop the record'}")
    return None, path


def _declared_size(head: bytes) -> tuple[int, int] | None:
    """The width and height a PNG, GIF or BMP header declares (to say why PIL would not open it), else None."""
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR" and len(head) >= 24:
        return struct.unpack(">II", head[16:24])
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        return struct.unpack("<HH", head[6:10])
    if head[:2] == b"BM" and len(head) >= 26:
        width, height = struct.unpack("<ii", head[18:26])
        return width, abs(height)
    return None


def _unidentified(where: str, what: str, file, fix: str | None) -> ValueError:
    file.seek(0)
    declared = _declared_size(file.read(32))
    if declared is not None and (declared[0] == 0 or declared[1] == 0):
        return _zero_size(where, what, *declared, fix)
    return ValueError(f"{where}: {what} is not an image PIL can read (formats read: {', '.join(FORMATS)}); "
                      f"{fix or 'replace it with a valid image file or drop the record'}")


def _zero_size(where: str, what: str, width: int, height: int, fix: str | None) -> ValueError:
    return ValueError(f"{where}: {what} is an image of {width} x {height} pixels (zero width or height): "
                      f"{fix or 'replace it with the real image or drop the record'}")


def _too_large(where: str, what: str, size: tuple[int, int] | None, max_pixels: int) -> ValueError:
    shown = f"{size[0]} x {size[1]} pixels" if size else "more pixels than PIL's decompression-bomb limit"
    return ValueError(f"{where}: {what} is too large to decode ({shown}; the limit is {max_pixels:,} pixels, and "
                      f"PIL's {Image.MAX_IMAGE_PIXELS:,}): downscale it first (the processor resizes it anyway)")


def _thirty_two_bit(where: str, what: str, mode: str) -> ValueError:
    return ValueError(f"{where}: {what} is a 32-bit {THIRTY_TWO_BIT_MODES[mode]} image (PIL mode {mode!r}), whose "
                      "range of values no file says: save it as an 8- or 16-bit image (PNG) and give that")


def _unreadable(where: str, what: str, error: BaseException, fix: str | None) -> ValueError:
    detail = " ".join(str(error).split()) or type(error).__name__
    return ValueError(f"{where}: {what} is not a readable image ({type(error).__name__}: {detail}); the file is "
                      f"damaged or truncated: {fix or 'replace it or drop the record'}")

