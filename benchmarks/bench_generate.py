"""Sampling speed for online RL (GRPO's groups): our ``generate_group`` against transformers' ``generate``.

    python benchmarks/bench_generate.py [--n 8] [--prompt 64] [--new 128] [--repeats 3] [--rounds 1] [--device cpu|cuda]

One random-weight Llama-shaped model (vocab 32000, hidden 512, 4 layers, heads 8/4), saved once by transformers and
loaded by both sides, so both run the same weights. One random prompt, ``n`` completions of ``--new`` tokens each,
sampled with the same processors (temperature 0.8, top-k 50, top-p 0.95) and no reachable end (no stop ids for ours,
``eos_token_id=None`` for transformers), so both produce the full length:

  ours          ``waypoint.models.sample_group.generate_group``: the prompt once, its cache copied to n rows into
                preallocated buffers, one batched step a token
  transformers  ``model.generate(input_ids.repeat(n, 1), do_sample=True, ...)`` (sdpa, its default dynamic cache)

each in a fresh process: one warm-up call, then the median of ``--repeats`` timed calls (prefill included), the
generated tokens/s (n x new over the call's time) and the ratio ours/transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False}
SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.95)
IMPLS = ("ours", "transformers")


def write_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)


def child(impl: str, path: str, args) -> dict:
    import torch

    device = torch.device(args.device)
    prompt = torch.randint(0, CONFIG["vocab_size"], (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    if impl == "ours":
        from waypoint.checkpointers import load_model
        from waypoint.models.generate import Sampling
        from waypoint.models.sample_group import generate_group

        model = load_model(Path(path)).to(device).eval()
        sampling = Sampling(**SAMPLING)

        def call(new: int, seed: int) -> int:
            rows = generate_group(model, prompt, args.n, new, sampling, generator=torch.Generator().manual_seed(seed))
            return sum(len(r) for r in rows)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).to(device).eval()
        input_ids = torch.tensor([prompt], device=device).repeat(args.n, 1)

        def call(new: int, seed: int) -> int:
            torch.manual_seed(seed)
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, max_new_tokens=new,
                                 eos_token_id=None, pad_token_id=0, **SAMPLING)
            return out[:, input_ids.shape[1]:].numel()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call(8, 0)  # warm-up
    times, produced = [], 0
    for seed in range(args.repeats):
        sync()
        start = time.perf_counter()
        produced = call(args.new, seed + 1)
        sync()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "tokens": produced}


def run_child(impl: str, path: str, args) -> dict | str:
    run = subprocess.run([sys.executable, __file__, "--child", impl, path, "--n", str(args.n), "--prompt", str(args.prompt),
                          "--new", str(args.new), "--repeats", str(args.repeats), "--device", args.device],
                         capture_output=True, text=True)
    if run.returncode:
        return run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit status {run.returncode}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="completions of the prompt (the group)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="new tokens a completion")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per process (the median is taken)")
    parser.add_argument("--rounds", type=int, default=1, help="run both this many times, interleaved; the median ratio")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args)))
        return
    c = CONFIG
    print(f"device {args.device}, fp32; Llama shape vocab {c['vocab_size']}, hidden {c['hidden_size']}, "
          f"{c['num_hidden_layers']} layers, heads {c['num_attention_heads']}/{c['num_key_value_heads']}; n={args.n}, prompt "
          f"{args.prompt}, {args.new} new tokens, sampling {SAMPLING}; median of {args.repeats} calls after a warm-up, "
          f"each side in a fresh process, {args.rounds} round(s)")
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp))
        runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
        for _ in range(args.rounds):
            for impl in IMPLS:
                r = run_child(impl, tmp, args)
                if isinstance(r, str):
                    sys.exit(f"{impl} failed: {r}")
                runs[impl].append(r)
    print(f"{'':14} {'call s':>8} {'tokens':>7} {'tokens/s':>9}")
    for impl, rs in runs.items():
        s = statistics.median(r["median_s"] for r in rs)
        print(f"{impl:14} {s:8.3f} {rs[0]['tokens']:7d} {rs[0]['tokens'] / s:9.0f}")
    speed = sorted(t["median_s"] / m["median_s"] for m, t in zip(runs["ours"], runs["transformers"]))
    spread = f" (rounds: {speed[0]:.2f}-{speed[-1]:.2f}x)" if len(speed) > 1 else ""
    print(f"ours / transformers: {statistics.median(speed):.2f}x the tokens/s{spread}")
    print("\ntarget: >= 1.5x transformers' tokens/s on a CPU")


if __name__ == "__main__":
    main()
