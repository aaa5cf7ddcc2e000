"""A tiny random Gemma 3 vision-language model in Hugging Face's layout, for trying vision-language fine-tuning on a
laptop (``configs/tiny_vlm.yaml``); ``python scripts/make_tiny.py gemma3_vl OUT`` writes the same:

    python scripts/make_tiny_vlm.py outputs/tiny_vlm_base

It writes what ``google/gemma-3-4b-it`` ships, at toy size: ``config.json`` (Gemma3ForConditionalGeneration: a
2-layer Gemma 3 text model, a 2-layer SigLIP tower on 28-pixel images, 4 tokens an image), ``model.safetensors``
(the text model under ``language_model.``, the tower under ``vision_tower.``, as transformers writes them), the tiny
Llama's tokenizer with Gemma 3's special tokens added, Gemma 3's chat template, and the image processor's
``preprocessor_config.json`` / ``processor_config.json``. transformers' ``Gemma3ForConditionalGeneration`` and
``AutoProcessor`` load it; Waypoint needs no transformers to make it."""

from __future__ import annotations

import sys
from pathlib import Path

# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import importlib.util  # noqa: E402

from waypoint.cli.command import OneLineParser, run_command  # noqa: E402


def _make_tiny():
    """scripts/make_tiny.py beside this file (a checkout's or a wheel's: the folder is not on the path)."""
    if "make_tiny" not in sys.modules:
        spec = importlib.util.spec_from_file_location("make_tiny", Path(__file__).with_name("make_tiny.py"))
        sys.modules["make_tiny"] = importlib.util.module_from_spec(spec)  # where its dataclasses look themselves up
        spec.loader.exec_module(sys.modules["make_tiny"])
    return sys.modules["make_tiny"]


def make(out: Path, seed: int = 0) -> Path:
    """``python scripts/make_tiny.py gemma3_vl OUT``: the same model, tokenizer, template and processor files."""
    return _make_tiny().make("gemma3_vl", out, seed)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser.for_script(__doc__)
    parser.add_argument("out", type=Path, help="the folder to write (new or empty)")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"{args.out}: not empty; name a new or empty folder")

    def run() -> int:
        print(f"wrote {make(args.out, args.seed)}")
        return 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
