"""What the quantized-base benchmarks share (``bench_mxfp4_load.py``, ``bench_fp8_load.py``): resident memory from
/proc, one LoRA training step's time and memory over a loaded model, each case in a fresh process, and the figures
printed side by side. Not a command of its own."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def rss_gb(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmHWM``: its peak since the last reset of /proc/self/clear_refs), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def load_lora_model(ckpt: Path, device: str, targets: list[str], method: str | None) -> tuple[object, dict]:
    """As recipes/lora_finetune.py loads it (meta build, LoRA on ``targets``, ``quantize_base: method``, one load in
    bf16), every parameter then read once (memory-mapped ones become resident): (the model, the load's figures: time,
    the runtime's resident memory, the peak over it, GPU peak, all parameters held, and quantize_base's lines)."""
    import torch

    from waypoint.checkpointers import HFCheckpointer, build_model, load_into
    from waypoint.models.lora import apply_lora, init_adapters
    from waypoint.models.swap import swapping_conversions
    from waypoint.training.quantize import quantize_base

    cuda = device.startswith("cuda")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts here: the imports are the runtime, reported apart
    runtime = rss_gb()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with swapping_conversions():
        checkpointer = HFCheckpointer(ckpt, output_dir=ckpt.parent / "unused")
        state = checkpointer.load_checkpoint()["model"]
        with torch.device("meta"):
            model = build_model(ckpt)
        apply_lora(model, targets, 8, 16.0)
        lines = quantize_base(model, "bf16", method, checkpointer=checkpointer)
        load_into(model, state, dtype=torch.bfloat16, device=device, fill_later=[k for k in model.state_dict() if ".lora_" in k])
        init_adapters(model, device)
        for p in model.parameters():
            for t in packed_parts(p):
                float(t.detach().float().sum())
        if cuda:
            torch.cuda.synchronize()
        out = {"load_s": time.perf_counter() - started, "runtime_gb": runtime, "load_rss_gb": rss_gb("VmHWM") - runtime,
               "held_gb": sum(held_bytes(p) for p in model.parameters()) / 1e9, "lines": lines}
        if cuda:
            out["load_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return model, out


def packed_parts(p) -> list:
    """The tensors a parameter holds: a packed weight's inner ones (``models.packed_weight``), else itself."""
    from waypoint.models.packed_weight import PackedWeight

    return [getattr(p, name) for name in p.__tensor_flatten__()[0]] if isinstance(p, PackedWeight) else [p]


def held_bytes(p) -> int:
    return sum(t.numel() * t.element_size() for t in packed_parts(p))


def lora_step(model, device: str, steps: int, seq_len: int) -> dict:
    """The median time of ``steps`` LoRA training steps (forward, backward, AdamW; after a warm-up) over ``model``,
    and what they add to the resident (or GPU) memory."""
    import torch

    cuda = device.startswith("cuda")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    tokens = torch.randint(0, model.args.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)
    model.train()
    Path("/proc/self/clear_refs").write_text("5")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before, times = rss_gb(), []
    for _ in range(steps + 1):  # the first is a warm-up
        begin = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    out = {"step_s": statistics.median(times[1:]), "step_rise_gb": rss_gb("VmHWM") - before}  # activations, saved, optimizer
    if cuda:
        out["step_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def run_children(script: str, kinds: tuple[str, ...], ckpt: Path, args: list[str]) -> dict[str, dict]:
    """``script --child KIND CKPT *args`` for each kind, each in a fresh process: kind -> the JSON it printed last."""
    got = {}
    for kind in kinds:
        result = subprocess.run([sys.executable, script, "--child", kind, str(ckpt), *args], capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{kind} failed:\n{result.stderr[-3000:]}")
        got[kind] = json.loads(result.stdout.strip().splitlines()[-1])
    return got


def print_table(label: str, got: dict[str, dict], held: tuple[str, str], cuda: bool, steps: int) -> None:
    """One row a kind: load time, the ``held`` (title, key) figure, all parameters held, load peak, step figures."""
    columns = [("load s", "load_s"), held, ("held GB", "held_gb"), ("load RSS GB", "load_rss_gb")]
    columns += [("load GPU GB", "load_gpu_gb")] if cuda else []
    columns += [("step s", "step_s"), ("step RSS+ GB", "step_rise_gb")] if steps else []
    columns += [("step GPU GB", "step_gpu_gb")] if cuda and steps else []
    print(f"{label:8}" + "".join(f" {title:>12}" for title, _ in columns))
    for kind, r in got.items():
        print(f"{kind:8}" + "".join(f" {r[key]:12.3f}" for _, key in columns))
