"""What a checkpoint directory is, at a glance.

    python scripts/inspect.py DIR

Prints the detected format and family, the weight files with their sizes, the keys
folded by layer with shapes and dtypes, total parameters and bytes, tied tensors,
and whether a Waypoint manifest verifies (the exit status is 1 when it does not, or when the
checkpoint cannot be read). Nothing is loaded beyond the headers (safetensors) or memory-mapped
(PyTorch files). DIR may also be an intermediate step of a torchrun run (``step_N/sharded/``, DCP):
its model keys come from DCP's metadata, and the run's input from ``recipe_state.pt``'s config. DIR may be
an object-store URL (``s3://bucket/run/step_400``), copied to the local cache first and read the same way.
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
import math  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from waypoint.checkpointers import checkpointer_for, detect_format  # noqa: E402
from waypoint.checkpointers.commit import MANIFEST, verify  # noqa: E402
from waypoint.checkpointers.file_formats import SAFETENSORS, format_of, load_pickle, read_metadata  # noqa: E402
from waypoint.checkpointers.load_report import fold_keys  # noqa: E402
from waypoint.checkpointers.quantization import FORMATS, describe_packed  # noqa: E402
from waypoint.checkpointers.native_checkpointer import ALIASES_KEY  # noqa: E402
from waypoint.run.object_store import local_copy  # noqa: E402
from waypoint.checkpointers.sharded_checkpoint import holds_sharded_model  # noqa: E402
from waypoint.cli.command import OneLineParser, run_command  # noqa: E402


def weight_files(ckpt) -> list[Path]:
    files = getattr(ckpt, "files", None) or ckpt.layout.files
    return sorted(ckpt.checkpoint_dir / f for f in files)


def tensor_headers(path: Path) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict]:
    """key -> (shape, dtype) and the file's metadata, without reading tensor data; a file that is not safetensors, is
    truncated or damaged is a one-line error naming it (``read_metadata``, which reads and checks the header)."""
    if format_of(path) == SAFETENSORS:
        metadata = read_metadata(path) or {}
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}, metadata
    state = load_pickle(path)
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}, {}


def _bytes_per(dtype: str) -> int:
    table = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2}
    if dtype in table:
        return table[dtype]
    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 1


def describe_sharded(directory: Path) -> list[str]:
    """A torchrun step: the model's keys, shapes and dtypes from DCP's metadata, its files, the run's input."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from waypoint.checkpointers.sharded_checkpoint import SHARDED_DIR, read_metadata
    from waypoint.run.recipe_state import load_recipe_state

    state = load_recipe_state(directory)
    config = state.get("config") or {}
    source = (config.get("checkpointer") or {}).get("checkpoint_dir", "?")
    shards = sorted((directory / SHARDED_DIR).glob("*.distcp"))
    lines = [f"{directory}: sharded step checkpoint of a {state.get('world_size', '?')}-process torchrun run (DCP), "
             f"step {state.get('global_step', '?')}; the run's input: {source}",
             f"{len(shards)} shard file(s) in {SHARDED_DIR}/, {sum(p.stat().st_size for p in shards) / 1e6:.2f} MB; "
             "python scripts/convert.py DIR OUT --to hf|meta|native writes it in a checkpoint format"]
    groups: dict[tuple, list[str]] = defaultdict(list)
    total_params = total_bytes = others = 0
    for key, meta in read_metadata(directory / SHARDED_DIR).state_dict_metadata.items():
        if not key.startswith("model.") or not isinstance(meta, TensorStorageMetadata):
            others += 1
            continue
        shape, dtype = tuple(meta.size), str(meta.properties.dtype).removeprefix("torch.")
        groups[(shape, dtype)].append(key.removeprefix("model."))
        total_params += meta.size.numel()
        total_bytes += meta.size.numel() * meta.properties.dtype.itemsize
    lines.append("model keys (native, folded by layer):")
    rows = [(pattern, shape, dtype) for (shape, dtype), keys in groups.items() for pattern in fold_keys(keys)]
    lines += [f"  {pattern:<60} {str(list(shape)):<16} {dtype}" for pattern, shape, dtype in sorted(rows)]
    lines.append(f"total: {total_params:,} parameters, {total_bytes / 1e9:.3f} GB of model tensors; "
                 f"{others} optimizer and other entries")
    return lines + [manifest_line(directory)]


def manifest_line(directory: Path) -> str:
    if not (directory / MANIFEST).is_file():
        return "manifest: none (not written by waypoint)"
    checked = verify(directory)
    return (f"manifest: {'verified' if checked.ok else 'FAILS: ' + checked.problem}"
            + (f", {checked.files} files, {checked.bytes / 1e9:.3f} GB" if checked.ok else ""))


def _values(ckpt, key: str, n: int) -> int:
    """The parameters ``n`` stored elements of ``key`` hold, as the model has them: a quantized checkpoint's packed
    MXFP4 bytes hold two FP4 values each, its scales (MXFP4's, block FP8's ``*_scale_inv``) none of their own."""
    quantized = getattr(ckpt, "quantized", None)
    if quantized is not None and quantized.method == "fp8" and key.endswith("_scale_inv"):
        return 0
    if quantized is None or not quantized.packed(key):
        return n
    return 2 * n if key.endswith("_blocks") else 0


def describe_fp8(quantized, headers: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """A block-FP8 checkpoint's weights, each beside its scales, and how many scale values they hold (which the
    parameter total leaves out: ``_values``)."""
    if quantized.method != "fp8":
        return []
    pairs: dict[tuple, list[str]] = defaultdict(list)
    for key, (shape, dtype) in headers.items():
        stem = key.removesuffix("_scale_inv")
        if key.endswith("_scale_inv") and stem in headers:
            pairs[(tuple(headers[stem][0]), headers[stem][1], tuple(shape), dtype)].append(stem)
    count = sum(math.prod(scales) * len(stems) for (_, _, scales, _), stems in pairs.items())
    rows = [f"  {pattern + '{,_scale_inv}':<60} {list(shape)} {dtype}, scales {list(scales)} {scale_dtype}"
            for (shape, dtype, scales, scale_dtype), stems in pairs.items() for pattern in fold_keys(stems)]
    return [f"quantized ({FORMATS['fp8'].format(block=list(quantized.block))}): {sum(map(len, pairs.values()))} "
            f"weights, {count:,} block scale values (not counted as parameters):"] + sorted(rows) if rows else []


def describe(directory: Path) -> list[str]:
    if holds_sharded_model(directory):
        return describe_sharded(directory)
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
            total_params += _values(ckpt, key, n)
            total_bytes += n * _bytes_per(dtype)
    lines.append("keys (folded by layer):")
    rows = [(pattern, shape, dtype) for (shape, dtype), keys in groups.items() for pattern in fold_keys(keys)]
    for pattern, shape, dtype in sorted(rows):
        lines.append(f"  {pattern:<60} {str(list(shape)):<16} {dtype}")
    lines.append(f"total: {total_params:,} parameters, {total_bytes / 1e9:.3f} GB of tensors")
    config = getattr(ckpt, "config", {}) or {}
    quantized = getattr(ckpt, "quantized", None)
    if quantized is not None:
        headers = {k: v for path in files for k, v in tensor_headers(path)[0].items()}
        lines += describe_packed(quantized.method, headers) + describe_fp8(quantized, headers)
    if aliases:
        lines.append("tied: " + ", ".join(f"{a} = {b} (stored once)" for a, b in aliases.items()))
    elif config.get("tie_word_embeddings"):
        lines.append("tied: lm_head.weight = model.embed_tokens.weight (stored once)")
    else:
        lines.append("tied: none")
    return lines + [manifest_line(directory)]


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when the checkpoint reads (and its manifest, if any, verifies), 1 otherwise."""
    parser = OneLineParser.for_script(__doc__)
    parser.add_argument("directory", help="a checkpoint directory, or its object-store URL (s3://bucket/run/step_400)")
    args = parser.parse_args(argv)

    def run() -> int:
        lines = describe(local_copy(args.directory, say=print))
        print("\n".join(lines))
        return 1 if any(line.startswith("manifest: FAILS") for line in lines) else 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
