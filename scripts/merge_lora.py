"""Merge a LoRA adapter (PEFT format: ours or PEFT's own) into its base checkpoint, offline.

    python scripts/merge_lora.py BASE_DIR ADAPTER_DIR OUT_DIR

OUT_DIR gets the base's format, file names and key -> file map (and its tokenizer and other side files; the
adapter's ``chat_template.jinja``, the template a LoRA run trained it with, where it has one), with every adapted
weight replaced by W + (lora_alpha / r) * B @ A (computed in fp32, cast back to W's dtype), committed atomically with
a MANIFEST.json. OUT_DIR must not exist yet, nor be or lie inside BASE_DIR
or ADAPTER_DIR, and is a local directory (a URL there is refused). An adapter whose tensors do not fit the base is
refused in one line; one whose adapter_config.json names another base (``base_model_name_or_path``, or the model
class PEFT records) is merged with a ``warning:`` line on stderr.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect);
# a checkout that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from waypoint.checkpointers import CheckpointError, checkpointer_for  # noqa: E402
from waypoint.checkpointers.peft_adapter import load_adapter, read_adapter_config, warn_other_base  # noqa: E402
from waypoint.cli.command import OneLineParser, run_command  # noqa: E402
from waypoint.cli.hub_source import base_model_name  # noqa: E402
from waypoint.models.lora import merge_state_dict  # noqa: E402
from waypoint.run.output_dir import local_output, refuse_overlap  # noqa: E402
from waypoint.text.inference_bundle import TEMPLATE_FILE  # noqa: E402


def merge(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    out_dir = local_output(out_dir, "OUT_DIR")
    refuse_overlap(out_dir, {"the base": base_dir, "the adapter": adapter_dir}, "OUT_DIR")
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: already exists; choose a new output directory")
    read_adapter_config(adapter_dir)  # a bad adapter fails before the base is read
    checkpointer = checkpointer_for(base_dir, output_dir=out_dir.parent)
    base = checkpointer.load_checkpoint()["model"]
    converter = checkpointer.hf_converter()
    adapter, config = load_adapter(adapter_dir, converter, base)  # a tensor that does not fit the base: one line
    warn_other_base(adapter_dir, config, checkpointer.checkpoint_dir, checkpointer.family,
                    base_model_name(checkpointer.checkpoint_dir))
    if converter.tied_embeddings and any(k.startswith(converter.native_head_key.rsplit(".", 1)[0] + ".lora_") for k in adapter):
        raise CheckpointError("the adapter changes the output head, which this base ties to the embedding")
    merged = merge_state_dict(base, adapter, float(config["lora_alpha"]) / int(config["r"]))
    template = Path(adapter_dir) / TEMPLATE_FILE
    if template.is_file():  # the merged model prompted as the adapter trained, as a LoRA run's merged/ is
        checkpointer.output_files[TEMPLATE_FILE] = template.read_bytes()
    return checkpointer.save_to({"model": merged}, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser.for_script(__doc__)
    parser.add_argument("base_dir")
    parser.add_argument("adapter_dir")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)

    def run() -> int:
        out = merge(args.base_dir, args.adapter_dir, args.out_dir)
        print(f"merged {args.adapter_dir} into {out}")
        return 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
