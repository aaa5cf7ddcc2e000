"""Convert a checkpoint between the HF, Meta and native formats (or re-shard it), offline.

    python scripts/convert.py IN_DIR OUT_DIR --to hf|meta|native [--from ...] [--model-type ...]
                              [--max-shard-size 5GB | --num-shards N] [--overwrite] [--no-verify]

By default the output has as many files as the input (for the same format: the very
same files and key -> file map). OUT_DIR must not exist or be empty, unless --overwrite, which
replaces it only once the new output is complete. OUT_DIR may not be IN_DIR, lie inside it or
contain it (real paths: symlinks are followed). Before the output is committed it is read back into a
fresh model whose logits on a fixed 2x64-token probe must match the input's (``--no-verify`` skips it).

IN_DIR may be an object-store URL (``s3://bucket/run/step_400``): it is copied to the local cache first. OUT_DIR is
a local directory: a URL there is refused.
IN_DIR may also be a sharded step checkpoint of a torchrun run (``step_N/sharded/``): its
model is read from the shards and written in the format, files and key -> file map of the
run's input checkpoint (``--to`` its format), or converted further. One process holds the
whole model for this.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect);
# a checkout that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from waypoint.checkpointers import CheckpointError, checkpointer_for, detect_format  # noqa: E402
from waypoint.checkpointers.formats import conversion_of, written_as  # noqa: E402
from waypoint.checkpointers.formats import convert as convert_checkpoint  # noqa: E402
from waypoint.checkpointers.export_check import ExportCheck  # noqa: E402
from waypoint.checkpointers.load_model import model_from  # noqa: E402
from waypoint.checkpointers.shard_layout import parse_size  # noqa: E402
from waypoint.checkpointers.sharded_checkpoint import holds_sharded_model  # noqa: E402
from waypoint.cli.command import OneLineParser, run_command  # noqa: E402
from waypoint.families import family_named  # noqa: E402
from waypoint.run.object_store import local_copy  # noqa: E402
from waypoint.run.output_dir import local_output, refuse_overlap  # noqa: E402
from waypoint.run.recipe_state import sharded_step_model  # noqa: E402


def special_token_ids(directory: Path) -> dict[str, int]:
    """bos/eos ids of the checkpoint's tokenizer, for a config.json made without a source one (generation stops at
    eos_token_id: a default would contradict the tokenizer)."""
    from waypoint.text.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(directory)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id)) if v is not None}


def convert(src: Path, dst: Path, to: str, source_format: str | None = None, model_type: str | None = None,
            max_shard_size: str | None = None, num_shards: int | None = None, overwrite: bool = False,
            verify: bool = True, say=print) -> Path:
    refuse_overlap(dst, {"the input": src}, "the output")  # before anything is read or written
    sharded = holds_sharded_model(src)
    fmt = None if sharded else detect_format(src)
    if source_format and not sharded and source_format != fmt:
        raise CheckpointError(f"--from {source_format}: {src} holds a {fmt} checkpoint")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise CheckpointError(f"{dst}: not empty; choose another directory or pass --overwrite")
    if sharded:
        ckpt, state, model = sharded_step_model(src, dst.parent)
        fmt, src = detect_format(ckpt.checkpoint_dir), ckpt.checkpoint_dir
        refuse_overlap(dst, {"the run's input": src}, "the output")
    else:
        kwargs = {"model_type": model_type} if model_type and fmt != "native" else {}
        ckpt = checkpointer_for(src, output_dir=dst.parent, **kwargs)
        state = ckpt.load_checkpoint()
        model = model_from(ckpt, state["model"]) if verify else None  # what the output must compute
    # None: the input's very files, keys and split (--to its format, unsharded)
    conversion = conversion_of(ckpt, to, model_type, num_shards, parse_size(max_shard_size) if max_shard_size else None,
                               special_token_ids(src))
    # The output is read back into a fresh model before it is committed, and must compute what the input does, as the
    # output's format holds it (weights changed since a block-FP8 source re-quantized: compared as re-quantized)
    check = ExportCheck(model, written=written_as(to, conversion)) if verify else None
    del model

    def write(target: Path) -> Path:
        return convert_checkpoint(ckpt, state, to, target, conversion, check)
    out = replace_dir(dst, write) if dst.exists() else write(dst)
    if check is not None:
        say(check.line)
    return out


def replace_dir(dst: Path, write) -> Path:
    """``write`` a new directory beside ``dst`` and swap it in: the old ``dst`` is deleted only once the new one is
    complete, so a failure (or a kill) at any moment leaves it as it was."""
    new, old = (dst.with_name(f".{dst.name}.{kind}-{os.getpid()}") for kind in ("new", "old"))
    write(new)
    try:
        dst.rename(old)
        new.rename(dst)
    except OSError:
        if old.exists() and not dst.exists():
            old.rename(dst)
        shutil.rmtree(new, ignore_errors=True)
        raise
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()
    return dst


def size(text: str) -> str:
    """--max-shard-size's check: argparse turns its ValueError into a one-line usage error."""
    if parse_size(text) <= 0:
        raise ValueError(text)
    return text


def count(text: str) -> int:
    """--num-shards's check: 0 would keep the input's files and -2 write one, without a word."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of files >= 1")
    return int(text)


def model_type(text: str) -> str:
    """--model-type's check, before the input is read: a family's model type (LLAMA3) or HF model_type (llama)."""
    try:
        family_named(text)
    except CheckpointError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser.for_script(__doc__)
    parser.add_argument("input", help="a checkpoint directory, or its object-store URL (s3://bucket/run/step_400)")
    parser.add_argument("output", metavar="OUT_DIR", help="a local directory (not a URL)")
    parser.add_argument("--to", required=True, choices=["hf", "meta", "native"])
    parser.add_argument("--from", dest="source_format", choices=["hf", "meta", "native"], help="default: detected")
    parser.add_argument("--model-type", type=model_type, help="LLAMA2, LLAMA3, MISTRAL, ... (default: detected)")
    shard = parser.add_mutually_exclusive_group()
    shard.add_argument("--max-shard-size", type=size, help="e.g. 5GB (HF and native outputs)")
    shard.add_argument("--num-shards", type=count, help="number of output files (Meta: model-parallel files)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty output directory (only once the new one is complete)")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="read the output back before committing it and compare its logits with the input's on "
                             "a 2x64-token probe (default: on; --no-verify skips it)")
    args = parser.parse_args(argv)

    def run() -> int:
        output = local_output(args.output, "OUT_DIR")  # before the input is fetched
        out = convert(local_copy(args.input, say=print), output, args.to, args.source_format, args.model_type, args.max_shard_size,
                      args.num_shards, args.overwrite, verify=args.verify)
        print(f"wrote {out}")
        return 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
