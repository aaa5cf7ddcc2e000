"""The files a vision-language checkpoint's processor is described by, read as transformers reads them: its
``processor_config.json`` / ``preprocessor_config.json`` and the special tokens its tokenizer config names. Shared by
each family's image processor and by ``vision.processors``, which picks one."""

from __future__ import annotations

import json
from pathlib import Path

from waypoint.vision.image_files import MAX_PIXELS

PROCESSOR_CONFIG = "processor_config.json"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
MODEL_CONFIG = "config.json"


def read_json(path: Path) -> dict:
    """A JSON object file's contents; ``{}`` when there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def token_names(config: dict, defaults: dict[str, str]) -> dict[str, str]:
    """The tokens ``defaults`` names, as a tokenizer_config.json names them (a string or ``{"content": ...}``, at the
    top level or in ``extra_special_tokens`` / ``model_specific_special_tokens``), else the defaults."""
    places = [config] + [config[k] for k in ("extra_special_tokens", "model_specific_special_tokens")
                         if isinstance(config.get(k), dict)]
    names = {}
    for key, default in defaults.items():
        value = next((place[key] for place in places if place.get(key) is not None), default)
        value = value.get("content") if isinstance(value, dict) else value
        names[key] = value if isinstance(value, str) and value else default
    return names


def single_id(tokenizer, token: str, name: str, source: str, family: str) -> int:
    """``token``'s id; a ``ValueError`` when the tokenizer does not read it as one token."""
    ids = tokenizer.encode(token, add_bos=False)
    if len(ids) != 1:
        raise ValueError(f"{source}: the tokenizer reads {name} {token!r} as {len(ids)} tokens, not one: it is not "
                         f"a {family} vision tokenizer (or tokenizer_config.json names another token)")
    return ids[0]


def image_processor_settings(directory: str | Path) -> tuple[dict, str]:
    """(the image processor's settings, where they were read) in a checkpoint or processor folder, where transformers
    looks: ``processor_config.json``'s ``image_processor`` if there is one, else ``preprocessor_config.json``; a
    one-line ``ValueError`` when neither is there."""
    directory = Path(directory)
    nested = read_json(directory / PROCESSOR_CONFIG).get("image_processor")
    if isinstance(nested, dict):
        return nested, f"{directory / PROCESSOR_CONFIG} (image_processor)"
    if not (directory / PREPROCESSOR_CONFIG).is_file():
        raise ValueError(f"{directory}: no image processor settings ({PREPROCESSOR_CONFIG}, or image_processor in "
                         f"{PROCESSOR_CONFIG}); is this a vision checkpoint?")
    return read_json(directory / PREPROCESSOR_CONFIG), str(directory / PREPROCESSOR_CONFIG)


def over_pixel_limit(source: str | None, what: str, pixels: int, fix: str) -> ValueError:
    """The one-line error for image processor settings (``what``: their keys and values) that make images of
    ``pixels`` pixels, over the limit on the images read (``vision.image_files.MAX_PIXELS``); ``fix`` says what to
    set instead; ``source`` (None: not named) is where the settings are. Raised when the settings are read, so that
    no image is resized to a size that cannot be held."""
    at = f"{source}: " if source else ""
    return ValueError(f"{at}{what} makes images of up to {pixels:,} pixels, over the {MAX_PIXELS:,}-pixel limit on "
                      f"images (vision.image_files.MAX_PIXELS); {fix}")
