"""Training step speed and memory: our native model and loop against transformers (and torchtune when installed).

    python benchmarks/bench_train.py [--shapes small,vocab128k] [--steps N] [--device cpu|cuda] [--dtype fp32|bf16]

The same Llama-shaped model (random weights), the same batch of random tokens and the same AdamW, built as:

  ours          ``waypoint.families.from_hf_config`` and the recipes' step (``training.loss.forward_backward``:
                the output projection fused with a chunked cross-entropy over the supervised positions only)
  ours-plain    the same model with the full logits materialised (``fused_loss: false``): what the fusion buys
  ours-ac       ours with activation checkpointing per block (``enable_activation_checkpointing: true``)
  ours-fused-adamw, transformers-fused-adamw  each with ``AdamW(fused=True)`` instead of foreach (what every shipped
                model config sets, ``optimizer.fused: true``; transformers' Trainer defaults to it too)
  transformers  ``LlamaForCausalLM`` (sdpa), its own loss (``labels=``)
  torchtune     ``torchtune.models.llama2.llama2`` and its ``CEWithChunkedOutputLoss`` (when installed)

Shape ``qwen3.5`` builds Qwen3.5's hybrid layers instead (``Qwen3_5ForCausalLM`` for transformers: on a CPU, or a GPU
without flash-linear-attention installed, its torch path of the delta rule; torchtune has none).

on random tokens, every position supervised (``small``, ``vocab128k``) or, as in chat data, only each sequence's
second half (``chat``: the prompts' labels -100), each in a fresh process: warm-up steps, then the median of the timed steps (forward, backward,
optimizer step, zero_grad), tokens/s, the peak memory over the steps (resident set on CPU, reset after the
model is built; ``torch.cuda.max_memory_allocated`` on CUDA) and the median step's minor page faults (on CPU the
memory a step gets afresh from the system, each page zero-filled by the kernel on first touch: where the two sides'
matmuls are the same, much of the difference). The ratios ours/theirs are printed side by side.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads, batch, seq)
    "small": (32000, 512, 1376, 4, 8, 4, 4, 256),
    "vocab128k": (128256, 512, 1376, 2, 8, 4, 2, 1024),  # Llama 3's vocabulary: the logits dominate
    "chat": (32000, 512, 1376, 4, 8, 4, 4, 256),  # small, the first half of each sequence a prompt (labels -100)
    "qwen3.5": (32000, 512, 1376, 4, 8, 2, 2, 1024),  # Qwen3.5's hybrid layers (HYBRID): 16 delta-rule chunks a sequence
}
# shapes of Qwen3.5's hybrid layers (Qwen3_5ForCausalLM; transformers' torch path, as without flash-linear-attention):
# three Gated DeltaNet layers to one gated-attention layer, in Qwen3.6-35B-A3B's proportions at a quarter of its width
# (its hidden 2048, DeltaNet key/value widths 2048/4096 in heads of 128, attention 16 heads of 256 over a quarter
# rotated), with a dense MLP: hidden 512, DeltaNet heads 4/8 of 128, attention 8 heads of 128
HYBRID = {"qwen3.5": dict(head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                          linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4)}
PROMPT = {"chat": 0.5}  # the share of each sequence whose labels are -100, as chat data's prompts (train_on_input: false)
STEPS = {"small": 8, "vocab128k": 3, "chat": 8, "qwen3.5": 4}  # timed steps unless --steps (a vocab128k step takes ~10 s on 2 CPU cores)
IMPLS = ("ours", "ours-plain", "ours-ac", "ours-fused-adamw", "transformers", "transformers-fused-adamw", "torchtune")
FUSED_ADAMW = "-fused-adamw"  # an impl with AdamW(fused=True) in place of foreach
WARMUP = 2


def hf_config(shape: str) -> dict:
    vocab, hidden, inter, layers, heads, kv, _, seq = SHAPES[shape]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "max_position_embeddings": max(seq, 2048), "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False}
    if shape in HYBRID:
        config.update(HYBRID[shape], architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text")
    return config


def peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def build(impl: str, shape: str, device, dtype):
    """(model, step(tokens, labels) -> loss) for ``impl``."""
    from waypoint.training.loss import forward_backward
    from waypoint.training.distributed import Distributed

    config = hf_config(shape)
    if impl.startswith("ours"):
        from waypoint.families import from_hf_config

        model = from_hf_config(config)
        model.init_weights()
        chunk = 0 if impl == "ours-plain" else None  # None: the recipes' default chunk
        model.activation_checkpointing = impl == "ours-ac"
        single = Distributed(device=device)

        def step(tokens, labels):
            loss, _, _ = forward_backward(model, [{"tokens": tokens, "labels": labels}], device, single, loss_chunk=chunk)
            return loss
    elif impl == "transformers":
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields), attn_implementation="sdpa")

        def step(tokens, labels):
            loss = model(input_ids=tokens, labels=labels).loss
            loss.backward()
            return loss.item()
    else:
        from torchtune.models.llama2 import llama2
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        vocab, hidden, inter, layers, heads, kv, _, seq = SHAPES[shape]
        model = llama2(vocab_size=vocab, num_layers=layers, num_heads=heads, num_kv_heads=kv, embed_dim=hidden,
                       max_seq_len=max(seq, 2048), intermediate_dim=inter)
        loss_fn = CEWithChunkedOutputLoss()
        model.set_num_output_chunks(loss_fn.num_output_chunks)

        def step(tokens, labels):
            loss = loss_fn(model(tokens), labels)  # labels already shifted, as torchtune's recipes do
            loss.backward()
            return loss.item()
    return model.to(device=device, dtype=dtype), step


def child(impl: str, shape: str, steps: int, device_name: str, dtype_name: str) -> dict:
    import torch

    device, dtype = torch.device(device_name), {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    model, step = build(impl.removesuffix(FUSED_ADAMW), shape, device, dtype)
    model.train()
    fused = impl.endswith(FUSED_ADAMW)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=not fused, fused=fused)
    vocab, *_, batch, seq = SHAPES[shape]
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    labels = tokens.clone()
    labels[:, : int(seq * PROMPT.get(shape, 0))] = -100
    if impl == "torchtune":  # torchtune's recipes shift the labels themselves
        labels = torch.cat([labels[:, 1:], torch.full((batch, 1), -100, device=device)], dim=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, faults, losses = [], [], []
    for i in range(WARMUP + steps):
        sync()
        start, faulted = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        losses.append(step(tokens, labels))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else peak_rss_gb()
    return {"median_s": statistics.median(times), "tokens": batch * seq, "peak_gb": peak, "first_loss": losses[0],
            "faults": statistics.median(faults)}


def run_child(impl: str, shape: str, args, dtype: str) -> dict | str:
    """One impl's figures from a fresh process, or the reason it failed."""
    run = subprocess.run([sys.executable, __file__, "--child", impl, shape, "--steps", str(args.steps or STEPS[shape]),
                          "--device", args.device, "--dtype", dtype], capture_output=True, text=True)
    if run.returncode:
        return run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit status {run.returncode}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def ratio_line(label: str, mine: list[dict], theirs: list[dict]) -> str:
    """tokens/s and peak memory of ``mine`` against ``theirs``, round by round (the same round runs both)."""
    speed = sorted(t["median_s"] / m["median_s"] for m, t in zip(mine, theirs))
    spread = f" (rounds: {speed[0]:.2f}-{speed[-1]:.2f}x)" if len(speed) > 1 else ""
    memory = statistics.median(m["peak_gb"] for m in mine) / statistics.median(t["peak_gb"] for t in theirs)
    return f"{label}: {statistics.median(speed):.2f}x the tokens/s{spread}, {memory:.2f}x the peak memory"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--impls", default=",".join(IMPLS), help="which rows to run (torchtune only when installed)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every impl this many times, interleaved, and take the median (a shared machine drifts)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default: per shape)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="fp32 (default on cpu) or bf16 (default on cuda)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.device, dtype)))
        return
    unknown = sorted(set(args.impls.split(",")) - set(IMPLS)) + sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        sys.exit(f"unknown impl or shape {', '.join(unknown)}; impls: {', '.join(IMPLS)}; shapes: {', '.join(SHAPES)}")
    impls = [i for i in args.impls.split(",") if i != "torchtune" or importlib.util.find_spec("torchtune")]
    every = impls
    if importlib.util.find_spec("transformers") is None:
        impls = [i for i in impls if not i.startswith("transformers")]
    print(f"device {args.device}, {dtype}, AdamW (foreach unless -fused-adamw); the median step after {WARMUP} warm-up, "
          f"each in a fresh process, {args.rounds} round(s)")
    for shape in args.shapes.split(","):
        vocab, hidden, inter, layers, heads, kv, batch, seq = SHAPES[shape]
        prompt = f", the first {PROMPT[shape]:.0%} of each sequence a prompt (labels -100)" if shape in PROMPT else ""
        print(f"\n{shape}: vocab {vocab}, hidden {hidden}, {layers} layers, heads {heads}/{kv}, batch {batch} x {seq}{prompt}, "
              f"{args.steps or STEPS[shape]} timed steps")
        impls = [i for i in every if not (i == "torchtune" and shape in HYBRID)]  # torchtune has no Qwen3.5
        runs: dict[str, list[dict]] = {impl: [] for impl in impls}
        for _ in range(args.rounds):
            for impl in impls:
                r = run_child(impl, shape, args, dtype)
                if isinstance(r, str):
                    print(f"{impl:24} failed: {r}")
                    runs.pop(impl)
                    impls = [i for i in impls if i != impl]
                else:
                    runs[impl].append(r)
        print(f"{'':24} {'step s':>8} {'tokens/s':>9} {'peak GB':>8} {'faults/step':>12} {'first loss':>11}")
        for impl, rs in runs.items():
            step, peak = statistics.median(r["median_s"] for r in rs), statistics.median(r["peak_gb"] for r in rs)
            faults = statistics.median(r["faults"] for r in rs)
            print(f"{impl:24} {step:8.3f} {rs[0]['tokens'] / step:9.0f} {peak:8.2f} {faults:12.0f} {rs[0]['first_loss']:11.4f}")
        pairs = [("ours", t, f"ours / {t}") for t in ("ours-plain", "transformers", "torchtune")]
        pairs += [(v, "ours", f"{v} / ours") for v in ("ours-ac", "ours-fused-adamw")]
        pairs += [("ours" + FUSED_ADAMW, "transformers" + FUSED_ADAMW, "both with fused AdamW, ours / transformers")]
        for mine, theirs, label in pairs:
            if mine in runs and theirs in runs:
                print(ratio_line(label, runs[mine], runs[theirs]))
    print("\ntargets: >= 1.2x transformers' tokens/s; <= 0.8x its peak memory on vocab128k; >= 1.5x its tokens/s on qwen3.5 "
          "(CPU: transformers' torch path of the delta rule)")


if __name__ == "__main__":
    main()
