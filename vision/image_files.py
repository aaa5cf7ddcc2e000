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
white, not dropped.
"""

from __future__ import annotations

import io
import re
import struct
import warnings
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

MAX_PIXELS = 2**26  # about 67 M pixels (8192 x 8192): past it an image is refused before it is decoded
# PIL decoders that only decode pixels (no plugin here calls another program).
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM", "TGA", "ICO")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def load_image(source, where: str, root: Path | None = None, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The image ``source`` (a path, relative ones under ``root``; raw ``bytes``; or ``{"bytes", "path"}``, the
    bytes preferred when both are there, as ``datasets`` does), decoded and converted to RGB; a ``ValueError``
    of one line naming ``where`` when it cannot be used."""
    data, path = _bytes_or_path(source, where, root)
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
                raise _unidentified(where, what, file) from None
            except Exception as e:  # a plugin's own errors on a malformed header (SyntaxError, struct.error, ...)
                raise _unreadable(where, what, e) from None
            with image:
                width, height = image.size
                if width <= 0 or height <= 0:
                    raise _zero_size(where, what, width, height)
                if width * height > max_pixels:
                    raise _too_large(where, what, (width, height), max_pixels)
                try:
                    image.load()
                    if image.getexif().get(0x0112) is not None:  # Orientation: upright, as datasets decodes it
                        image = ImageOps.exif_transpose(image)
                    return convert_to_rgb(image)
                except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                    raise _too_large(where, what, (width, height), max_pixels) from None
                except Exception as e:  # truncated or corrupt data: OSError, ValueError, SyntaxError, ...
                    raise _unreadable(where, what, e) from None


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB as ``transformers.image_transforms.convert_to_rgb`` makes it: an image with an alpha band or
    a transparent colour is composited onto white; others are converted by PIL."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _bytes_or_path(source, where: str, root: Path | None) -> tuple[bytes | None, Path | None]:
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
        raise ValueError(f"{where}: {shown!r} is a URL; images are read from local files only: download it and "
                         "give its path (relative to the data file) or its bytes")
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
        raise ValueError(f"{where}: {path} is empty (0 bytes); replace it with the image or drop the record")
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


def _unidentified(where: str, what: str, file) -> ValueError:
    file.seek(0)
    declared = _declared_size(file.read(32))
    if declared is not None and (declared[0] == 0 or declared[1] == 0):
        return _zero_size(where, what, *declared)
    return ValueError(f"{where}: {what} is not an image PIL can read (formats read: {', '.join(FORMATS)}); "
                      "replace it with a valid image file or drop the record")


def _zero_size(where: str, what: str, width: int, height: int) -> ValueError:
    return ValueError(f"{where}: {what} is an image of {width} x {height} pixels (zero width or height): "
                      "replace it with the real image or drop the record")


def _too_large(where: str, what: str, size: tuple[int, int] | None, max_pixels: int) -> ValueError:
    shown = f"{size[0]} x {size[1]} pixels" if size else "more pixels than PIL's decompression-bomb limit"
    return ValueError(f"{where}: {what} is too large to decode ({shown}; the limit is {max_pixels:,} pixels, and "
                      f"PIL's {Image.MAX_IMAGE_PIXELS:,}): downscale it first (the processor resizes it anyway)")


def _unreadable(where: str, what: str, error: BaseException) -> ValueError:
    detail = " ".join(str(error).split()) or type(error).__name__
    return ValueError(f"{where}: {what} is not a readable image ({type(error).__name__}: {detail}); the file is "
                      "damaged or truncated: replace it or drop the record")

