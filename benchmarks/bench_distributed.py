"""Multi-process training and checkpointing: tokens/s, how long saves block training, export memory.

    python benchmarks/bench_distributed.py [--nproc 2] [--device cpu|cuda] [--size-gb 0.25] [--shards 4] [--steps 2]

Builds a Llama-shaped HF checkpoint (bf16, ``--shards`` files; the same builder as
bench_checkpoint.py), then runs itself under torchrun: every rank loads its piece of
the checkpoint into an FSDP2-sharded model (fp32), trains ``--steps`` steps on random
tokens, and then, side by side in one run:

  export       the model in the input's format, gathered to rank 0 one tensor at a time (first, on a
               fresh heap, for its memory figure)
  sync save    a sharded step checkpoint (model + AdamW state), training blocked until committed
  async save   the same with dcp.async_save: blocked only while the shards are copied to CPU memory
               (on a CPU-only machine that copy costs about what the page-cache write does)

and prints the figures and the ratio async-blocked / sync-blocked, and rank 0's RSS rise during
the export against the model's size and the largest output file (Linux: peak RSS reset
through /proc/self/clear_refs). On a GPU machine pass ``--device cuda --nproc <GPUs>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Not this folder on the path (the benchmarks import each other as benchmarks.NAME, from the root); a checkout
# that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def worker(checkpoint: str, work: str, device: str, steps: int, seq: int, batch: int) -> None:
    import torch

    from waypoint.checkpointers import HFCheckpointer, build_model, load_into
    from waypoint.checkpointers.dtensor_state import serve_gathers
    from waypoint.run.recipe_state import optimizer_state
    from waypoint.run.savers import SaveOptions, StepContent
    from waypoint.run.sharded_saver import ShardedSaver
    from waypoint.run.step_content import write_gathered
    from waypoint.training.distributed import init_distributed
    from waypoint.training.fsdp import shard_model

    dist = init_distributed(device)
    started = time.perf_counter()
    checkpointer = HFCheckpointer(checkpoint, output_dir=work)
    state = checkpointer.load_checkpoint()
    with torch.device("meta"):
        model = build_model(checkpoint)
    shard_model(model, dist.mesh)
    load_into(model, state["model"], dtype="fp32", device=dist.device)
    del state
    load_s = time.perf_counter() - started
    # Export first: later saves free large buffers that the heap keeps, which would hide its memory.
    quiet = lambda line: None  # noqa: E731
    model_bytes = int(dist.sum(sum(p.to_local().numel() * p.element_size() for p in model.parameters())))
    if dist.is_main:
        Path("/proc/self/clear_refs").write_text("5")
    rss_before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    model_state = model.state_dict()  # only the model in the input's format, gathered file by file as a final step writes it
    export = StepContent({}, lambda _: lambda stage: write_gathered(stage, checkpointer, model_state),
                         serve=lambda: serve_gathers(model_state))
    ShardedSaver(dist, Path(work) / "export", report=quiet).save(1, export, final=True)
    export_s = time.perf_counter() - t0
    rss_peak = _status_kb("VmHWM")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.args.vocab_size
    gen = torch.Generator().manual_seed(dist.rank)

    def train_steps(n: int) -> float:
        if dist.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            tokens = torch.randint(vocab, (batch, seq + 1), generator=gen).to(dist.device)
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if dist.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    train_steps(1)  # warm-up: lazy init, optimizer state
    train_s = train_steps(steps)
    tokens_per_s = dist.sum(steps * batch * seq) / train_s

    def shards():  # only every rank's DCP shards of the model and optimizer, as an intermediate step holds them
        optim = optimizer_state(model, optimizer)
        return StepContent({}, lambda _: lambda stage: None, sharded={"model": model.state_dict(), "optimizer": optim["state"]})

    sync = ShardedSaver(dist, Path(work) / "sync", report=quiet)
    t0 = time.perf_counter()
    sync.save(1, shards())
    sync_blocked = time.perf_counter() - t0

    background = ShardedSaver(dist, Path(work) / "async", SaveOptions(asynchronous=True), report=quiet)
    t0 = time.perf_counter()
    background.save(1, shards())
    async_blocked = time.perf_counter() - t0
    overlapped = train_steps(steps)  # training while the shards are written
    t1 = time.perf_counter()
    background.close()
    async_wait = time.perf_counter() - t1
    async_total = time.perf_counter() - t0

    if dist.is_main:
        sharded_bytes = sum(p.stat().st_size for p in (Path(work) / "sync/step_1").rglob("*") if p.is_file())
        largest = max(p.stat().st_size for p in (Path(work) / "export/step_1").glob("*.safetensors"))
        print(json.dumps({
            "processes": dist.world_size, "device": str(dist.device.type), "load_s": load_s,
            "tokens_per_s": tokens_per_s, "train_step_s": train_s / steps, "steps_while_saving_s": overlapped / steps,
            "sharded_checkpoint_gb": sharded_bytes / 1e9, "sync_blocked_s": sync_blocked,
            "async_blocked_s": async_blocked, "async_wait_at_end_s": async_wait, "async_total_s": async_total,
            "export_s": export_s, "model_gb": model_bytes / 1e9, "largest_file_gb": largest / 1e9,
            "export_rss_rise_gb": (rss_peak - rss_before) * 1024 / 1e9}))
    dist.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size-gb", type=float, default=0.25, help="bf16 checkpoint size (fp32 in training: twice)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, device=args.device, steps=args.steps, seq=args.seq, batch=args.batch)
        return

    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_checkpoint", Path(__file__).with_name("bench_checkpoint.py"))
    bench_checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_checkpoint)
    build_checkpoint = bench_checkpoint.build_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench_distributed_"))
    try:
        build_checkpoint(work / "ckpt", args.size_gb, args.shards)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--device", args.device, "--steps", str(args.steps), "--seq", str(args.seq),
               "--batch", str(args.batch), "--worker", str(work / "ckpt"), str(work / "out")]
        result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0:
            sys.exit(result.stderr[-4000:])
        f = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
        print(f"{f['processes']} processes on {f['device']}; model {f['model_gb']:.2f} GB (fp32), "
              f"sharded checkpoint {f['sharded_checkpoint_gb']:.2f} GB")
        print(f"  load (each rank its piece)       {f['load_s']:.2f} s")
        print(f"  training                         {f['tokens_per_s']:.0f} tokens/s ({f['train_step_s']:.2f} s/step; "
              f"{f['steps_while_saving_s']:.2f} s/step while an async save runs)")
        print(f"  sync sharded save, blocked       {f['sync_blocked_s']:.2f} s")
        print(f"  async sharded save, blocked      {f['async_blocked_s']:.2f} s  (then {f['async_wait_at_end_s']:.2f} s "
              f"waited at the end; {f['async_total_s']:.2f} s until committed)")
        print(f"  async blocked / sync blocked     {f['async_blocked_s'] / f['sync_blocked_s']:.2f}x")
        print(f"  export in the input's format     {f['export_s']:.2f} s; rank 0 RSS rise {f['export_rss_rise_gb']:.2f} GB "
              f"= {f['export_rss_rise_gb'] / f['model_gb']:.2f}x the model, "
              f"{f['export_rss_rise_gb'] / f['largest_file_gb']:.2f}x the largest file ({f['largest_file_gb']:.2f} GB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
