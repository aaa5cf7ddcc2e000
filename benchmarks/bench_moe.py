"""Step time (forward + backward) of the native mixture-of-experts block, per implementation.

    python benchmarks/bench_moe.py [--device cpu|cuda] [--dtype float32|bfloat16] [--iters 5] [--warmup 2] [--threads N]

Times ``waypoint.models.moe.MoE`` on two shapes scaled down from the families (the defaults fit a CPU):

  mixtral-like  dim 512, hidden 1024, 8 experts, top-2, 2048 tokens
  qwen3moe-like dim 512, hidden 192, 128 experts, top-8 (renormalised), 2048 tokens

for each implementation: ``auto`` (what the block picks here: ``grouped`` when this torch's grouped_mm runs on
the device and dtype, otherwise the ``padded`` bmm fallback), ``padded`` (the fallback, always shown) and
``loop`` (one expert at a time, the reference). A step is forward, ``backward`` of a fixed random projection
of the output, and dropping the gradients; after ``--warmup`` untimed steps, the median of ``--iters`` timed
ones is reported (and the spread, max / min). The implementations run interleaved, step by step, so a slow
spell of a shared machine hits each alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

# Not this folder on the path (the benchmarks import each other as benchmarks.NAME, from the root); a checkout
# that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name: (dim, hidden_dim, n_experts, top_k, tokens)
    "mixtral-like": (512, 1024, 8, 2, 2048),
    "qwen3moe-like": (512, 192, 128, 8, 2048),
}


def time_steps(block, x, grad, impls: list[str], warmup: int, iters: int, sync) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for i in range(warmup + iters):
        for impl in impls[i % len(impls):] + impls[: i % len(impls)]:  # rotated, so no impl always runs first
            block.impl = impl
            sync()
            start = time.perf_counter()
            out, _ = block(x)
            out.backward(grad)
            sync()
            elapsed = time.perf_counter() - start
            block.zero_grad(set_to_none=True)
            x.grad = None
            if i >= warmup:
                times[impl].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step for every shape (default: 2048)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()

    import torch

    from waypoint.models.moe import MoE, grouped_mm_supported

    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else f', {torch.get_num_threads()} threads'}"
          f", {args.dtype}; grouped_mm supported here: {grouped_mm_supported(device, dtype)}; "
          f"median of {args.iters} steps after {args.warmup} warm-up")
    print(f"{'shape':14} {'dim':>4} {'hid':>5} {'E':>4} {'k':>2} {'tokens':>6}  {'auto':>15} {'padded ms':>10} {'loop ms':>9}"
          f"  {'loop/auto':>9} {'loop/padded':>11}  {'spread a/p/l':>14}")
    for name in args.shapes:
        dim, hidden, n_experts, top_k, tokens = SHAPES[name]
        tokens = args.tokens or tokens
        torch.manual_seed(0)
        block = MoE(dim, hidden, n_experts, top_k, normalize_topk=True).to(device, dtype)
        x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, dim, device=device, dtype=dtype)
        block.impl = "auto"
        auto = block.resolved_impl(x)
        impls = [auto] + [i for i in ("padded", "loop") if i != auto]
        times = time_steps(block, x, grad, impls, args.warmup, args.iters, sync)
        med = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
        spread = {impl: max(t) / min(t) for impl, t in times.items()}
        print(f"{name:14} {dim:4d} {hidden:5d} {n_experts:4d} {top_k:2d} {tokens:6d}  "
              f"{f'{med[auto]:.1f} ({auto})':>15} {med['padded']:10.1f} {med['loop']:9.1f}  "
              f"{med['loop'] / med[auto]:8.2f}x {med['loop'] / med['padded']:10.2f}x  "
              f"{spread[auto]:.2f}/{spread['padded']:.2f}/{spread['loop']:.2f}")


if __name__ == "__main__":
    main()
