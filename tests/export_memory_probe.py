"""Rank 0's memory while a sharded model is exported in its input's format (run as torchrun runs it: two ranks).

    torchrun --nproc_per_node 2 tests/export_memory_probe.py CHECKPOINT_DIR OUTPUT_DIR

Loads the HF checkpoint into an FSDP2-sharded model, resets rank 0's peak RSS (Linux
``/proc/self/clear_refs``), writes ``OUTPUT_DIR/step_1`` as the recipe's final save does,
and prints one JSON line: RSS before the export, peak RSS during it, the model's bytes
and the largest output file's.
"""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from waypoint.checkpointers import HFCheckpointer, build_model, load_into  # noqa: E402
from waypoint.checkpointers.dtensor_state import serve_gathers  # noqa: E402
from waypoint.run.savers import StepContent  # noqa: E402
from waypoint.run.sharded_saver import ShardedSaver  # noqa: E402
from waypoint.run.step_content import write_gathered  # noqa: E402
from waypoint.training.distributed import init_distributed  # noqa: E402
from waypoint.training.fsdp import shard_model  # noqa: E402


def status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def main(source: str, output: str) -> None:
    dist = init_distributed("cpu")
    checkpointer = HFCheckpointer(source, output_dir=output)
    state = checkpointer.load_checkpoint()
    with torch.device("meta"):
        model = build_model(source)
    shard_model(model, dist.mesh)
    load_into(model, state["model"])
    del state
    gc.collect()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if dist.is_main:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = status_kb("VmRSS")
    model_state = model.state_dict()  # only the model in the input's format, gathered file by file as a final step writes it
    export = StepContent({}, lambda _: lambda stage: write_gathered(stage, checkpointer, model_state),
                         serve=lambda: serve_gathers(model_state))
    ShardedSaver(dist, output, report=lambda line: None).save(1, export, final=True)
    peak = status_kb("VmHWM")
    if dist.is_main:
        largest = max(p.stat().st_size for p in (Path(output) / "step_1").glob("*.safetensors"))
        print(json.dumps({"rss_before": before * 1024, "rss_peak": peak * 1024, "model_bytes": model_bytes,
                          "largest_file": largest}))
    dist.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
