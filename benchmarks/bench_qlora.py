"""QLoRA's memory and speed beside LoRA over the same base in bf16, in one run.

    python benchmarks/bench_qlora.py [--size-gb 1.0] [--steps 3] [--seq-len 64] [--device cpu]

Builds a Llama-shaped HF checkpoint (bf16 safetensors), then measures, each in a fresh process:

  load-bf16   meta build + LoRA + load_into(dtype=bf16), every parameter read (the LoRA base in memory)
  load-nf4    the same with quantize_base: nf4: each linear weight quantized as it is read
  step-bf16   a LoRA training step (forward, backward, AdamW) over the bf16 base: median seconds of --steps
  step-nf4    the same over the NF4 base

Peak RSS is the process's resident peak over the measured part (VmHWM reset after the imports; the runtime's
own resident memory is reported apart). The NF4 load must stay within the NF4 model's bytes (4-bit linears plus
what stays bf16) + the largest single tensor + the runtime. On a GPU (--device cuda) the model lives in GPU
memory and the figures are torch.cuda.max_memory_allocated, with RSS beside them.
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

TARGETS = ["q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3"]
BLOCK, SCALER_BLOCK = 64, 256


def shapes_for(size_gb: float) -> tuple[int, int, int, int, int]:
    """(hidden, intermediate, heads, vocab, layers) of a Llama whose bf16 weights are about ``size_gb``."""
    hidden, intermediate, heads, vocab = (2048, 5632, 16, 32000) if size_gb >= 0.5 else (512, 1536, 8, 4096)
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden)
    return hidden, intermediate, heads, vocab, max(1, round((size_gb * 1e9 - 4 * vocab * hidden) / per_layer))


def build_checkpoint(path: Path, size_gb: float) -> int:
    import torch
    from safetensors.torch import save_file

    hidden, intermediate, heads, vocab, n_layers = shapes_for(size_gb)
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    total, index = 0, {}
    for i in range(n_layers + 1):  # one file per layer, the embedding and head in the last
        tensors = {}
        if i < n_layers:
            p = f"model.layers.{i}."
            shapes = {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                      **{p + f"self_attn.{n}.weight": (hidden, hidden) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                      p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                      p + "mlp.down_proj.weight": (hidden, intermediate)}
        else:
            shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
        for key, shape in shapes.items():
            tensors[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            total += tensors[key].numel() * 2
        name = f"model-{i + 1:05d}-of-{n_layers + 1:05d}.safetensors"
        save_file(tensors, path / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
        "num_attention_heads": heads, "num_key_value_heads": heads, "num_hidden_layers": n_layers, "vocab_size": vocab,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}))
    return total


def shapes_for_checkpoint(ckpt: Path) -> tuple[int, int]:
    config = json.loads((ckpt / "config.json").read_text())
    return config["hidden_size"], config["intermediate_size"]


def rss_gb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def child(step: str, ckpt: Path, device: str, steps: int, seq_len: int) -> dict:
    import torch

    from waypoint.checkpointers import HFCheckpointer, build_model, load_into
    from waypoint.lazy import nbytes
    from waypoint.models.lora import apply_lora, init_adapters
    from waypoint.models.nf4 import is_nf4, nf4_nbytes, nf4_tensor_class, quantize_linears
    from waypoint.models.swap import swapping_conversions

    NF4Tensor = nf4_tensor_class()  # both variants import the same libraries before the baseline
    hidden, intermediate = shapes_for_checkpoint(ckpt)
    Path("/proc/self/clear_refs").write_text("5")
    runtime = rss_gb()
    # torchao's quantizer works through 2^20 values at a time against the 16 NF4 levels: a fixed workspace,
    # measured here on the largest linear weight alone (and counted with the runtime in the bound)
    sample = torch.randn(intermediate, hidden, dtype=torch.bfloat16)
    NF4Tensor.from_tensor(sample, BLOCK, SCALER_BLOCK)
    workspace = rss_gb("VmHWM") - runtime - sample.numel() * 2 / 1e9
    del sample
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts here: the imports are the runtime, reported apart
    runtime = rss_gb()
    started = time.perf_counter()
    with swapping_conversions():
        state = HFCheckpointer(ckpt, output_dir=ckpt.parent / "unused").load_checkpoint()["model"]
        largest = max(nbytes(state, k) for k in state)
        with torch.device("meta"):
            model = build_model(ckpt)
        apply_lora(model, TARGETS, 8, 16.0)
        if step.endswith("nf4"):
            quantize_linears(model, torch.bfloat16, BLOCK, SCALER_BLOCK)
        load_into(model, state, dtype=torch.bfloat16, device=device, fill_later=[k for k in model.state_dict() if ".lora_" in k])
        init_adapters(model, device)
        held = sum(nf4_nbytes(p) if is_nf4(p) else p.numel() * p.element_size() for p in model.parameters())
        for p in model.parameters():  # every weight read: the mmap-assigned bf16 ones become resident
            float((p.quantized_data if is_nf4(p) else p).detach().sum())
        load_s = time.perf_counter() - started
        out = {"load_s": load_s, "held_gb": held / 1e9, "largest_gb": largest / 1e9, "runtime_gb": runtime, "workspace_gb": workspace,
               "peak_rss_gb": rss_gb("VmHWM")}
        if device.startswith("cuda"):
            out["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        if step.startswith("step"):
            del state
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-4)
            tokens = torch.randint(0, model.args.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)
            times = []
            for _ in range(steps + 1):  # the first is a warm-up
                begin = time.perf_counter()
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - begin)
            out["step_s"] = statistics.median(times[1:])
    return out


def fresh_process(argv: list[str]) -> str:
    """This script with ``argv`` in a fresh Python process: its stdout (the tests fork it with the imports done)."""
    result = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def run_child(step: str, ckpt: Path, args) -> dict:
    out = fresh_process(["--child", step, str(ckpt), "--device", args.device, "--steps", str(args.steps),
                         "--seq-len", str(args.seq_len)])
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-steps", action="store_true", help="measure the loads only")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), args.device, args.steps, args.seq_len)))
        return
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_qlora_") as work:
        ckpt = Path(work) / "ckpt"
        total = build_checkpoint(ckpt, args.size_gb)
        print(f"checkpoint: {total / 1e9:.3f} GB bf16 (Llama, hidden {shapes_for(args.size_gb)[0]}, "
              f"{shapes_for(args.size_gb)[4]} layers); LoRA on {', '.join(TARGETS)}; NF4 blocks {BLOCK}/{SCALER_BLOCK}")
        steps = ["load-bf16", "load-nf4"] if args.no_steps else ["step-bf16", "step-nf4"]
        got = {s.rsplit("-", 1)[1]: run_child(s, ckpt, args) for s in steps}
        print(f"{'base':6} {'load s':>7} {'held GB':>8} {'peak RSS GB':>12} {'over runtime':>13}"
              + (f" {'peak GPU GB':>12}" if args.device.startswith("cuda") else "") + (f" {'step s':>7}" if not args.no_steps else ""))
        for name, r in got.items():
            print(f"{name:6} {r['load_s']:7.2f} {r['held_gb']:8.3f} {r['peak_rss_gb']:12.3f} {r['peak_rss_gb'] - r['runtime_gb']:13.3f}"
                  + (f" {r['peak_gpu_gb']:12.3f}" if "peak_gpu_gb" in r else "") + (f" {r['step_s']:7.3f}" if "step_s" in r else ""))
        bf16, nf4 = got["bf16"], got["nf4"]
        key = "peak_gpu_gb" if args.device.startswith("cuda") else "peak_rss_gb"
        over = lambda r: r[key] - (0 if key == "peak_gpu_gb" else r["runtime_gb"])  # noqa: E731
        bound = nf4["held_gb"] + nf4["largest_gb"] + (nf4["workspace_gb"] if key == "peak_rss_gb" else 0)
        print(f"load memory, NF4 / bf16: {over(nf4) / over(bf16):.2f}x over the runtime ({nf4[key] / bf16[key]:.2f}x in all); "
              f"NF4 peak {over(nf4):.3f} GB vs bound: held {nf4['held_gb']:.3f} + largest tensor {nf4['largest_gb']:.3f} + "
              f"quantizer workspace {nf4['workspace_gb']:.3f} = {bound:.3f} GB -> {'within' if over(nf4) <= bound else 'OVER'}")
        if not args.no_steps:
            print(f"step time, QLoRA / LoRA over bf16: {nf4['step_s'] / bf16['step_s']:.2f}x "
                  f"({nf4['step_s']:.3f} s vs {bf16['step_s']:.3f} s, seq {args.seq_len}, {args.device})")
        print(json.dumps({"size_gb": total / 1e9, **{f"{n}_{k}": v for n, r in got.items() for k, v in r.items()}}))


if __name__ == "__main__":
    main()
