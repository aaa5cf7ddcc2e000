"""What a checkpoint directory is, at a glance.

    python scripts/inspect.py DIR

Prints the detected format and family, the weight files with their sizes, the keys
folded by layer with shapes and dtypes, total parameters and bytes, tied tensors,
and whether a Waypoint manifest verifies (the exit status is 1 when it does not, or when the
checkpoint cannot be read). Nothing is loaded beyond the headers (safetensors) or memory-mapped
(PyTorch files).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "inspect":
    # Another script of this folder ran, so this file was found in place of the standard library's
    # `inspect`: become that module (load it from the standard library and take over its names).
    import importlib.util
    import sysconfig

    _spec = importlib.util.spec_from_file_location("inspect", Path(sysconfig.get_paths()["stdlib"]) / "inspect.py")
    _real = importlib.util.module_from_spec(_spec)
    sys.modules["inspect"] = _real
    _spec.loader.exec_module(_real)
    # The importer receives sys.modules["inspect"], the real one; the rest of this file still runs here.

# Run as a script, this folder is sys.path[0] and this file's name is the standard library's
# `inspect` (which torch imports): the repository root takes its place before anything else is imported.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import json  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from waypoint.checkpointers import CheckpointError, checkpointer_for, detect_format  # noqa: E402
from waypoint.checkpointers.commit import MANIFEST, verify  # noqa: E402
from waypoint.checkpointers.file_formats import SAFETENSORS, format_of, load_pickle  # noqa: E402
from waypoint.checkpointers.load_report import fold_keys  # noqa: E402
from waypoint.checkpointers.native_checkpointer import ALIASES_KEY  # noqa: E402
from waypoint.training.cli import OneLineParser, run_command  # noqa: E402


def weight_files(ckpt) -> list[Path]:
    files = getattr(ckpt, "files", None) or ckpt.layout.files
    return sorted(ckpt.checkpoint_dir / f for f in files)


def tensor_headers(path: Path) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict]:
    """key -> (shape, dtype) and the file's metadata, without reading tensor data."""
    if format_of(path) == SAFETENSORS:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}, f.metadata() or {}
    state = load_pickle(path)
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}, {}


def _bytes_per(dtype: str) -> int:
    table = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2}
    if dtype in table:
        return table[dtype]
    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 1


def describe(directory: Path) -> list[str]:
    fmt = detect_format(directory)
    ckpt = checkpointer_for(directory)
    lines = [f"{directory}: {fmt} checkpoint, model type {ckpt.model_type}"]
    files = weight_files(ckpt)
    groups: dict[tuple, list[str]] = defaultdict(list)
    total_params = total_bytes = 0
    aliases = {}
    lines.append(f"{len(files)} weight file(s):")
    for path in files:
        headers, metadata = tensor_headers(path)
        aliases.update(json.loads(metadata.get(ALIASES_KEY, "{}")))
        lines.append(f"  {path.name:<40} {path.stat().st_size / 1e6:10.2f} MB  {len(headers)} tensors")
        for key, (shape, dtype) in headers.items():
            groups[(shape, dtype)].append(key)
            n = 1
            for d in shape:
                n *= d
            total_params += n
            total_bytes += n * _bytes_per(dtype)
    lines.append("keys (folded by layer):")
    rows = [(pattern, shape, dtype) for (shape, dtype), keys in groups.items() for pattern in fold_keys(keys)]
    for pattern, shape, dtype in sorted(rows):
        lines.append(f"  {pattern:<60} {str(list(shape)):<16} {dtype}")
    lines.append(f"total: {total_params:,} parameters, {total_bytes / 1e9:.3f} GB of tensors")
    config = getattr(ckpt, "config", {}) or {}
    if aliases:
        lines.append("tied: " + ", ".join(f"{a} = {b} (stored once)" for a, b in aliases.items()))
    elif config.get("tie_word_embeddings"):
        lines.append("tied: lm_head.weight = model.embed_tokens.weight (stored once)")
    else:
        lines.append("tied: none")
    if (directory / MANIFEST).is_file():
        checked = verify(directory)
        lines.append(f"manifest: {'verified' if checked.ok else 'FAILS: ' + checked.problem}"
                     + (f", {checked.files} files, {checked.bytes / 1e9:.3f} GB" if checked.ok else ""))
    else:
        lines.append("manifest: none (not written by waypoint)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when the checkpoint reads (and its manifest, if any, verifies), 1 otherwise."""
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)

    def run() -> int:
        lines = describe(args.directory)
        print("\n".join(lines))
        return 1 if any(line.startswith("manifest: FAILS") for line in lines) else 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
