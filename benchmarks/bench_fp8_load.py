"""Loading (and one LoRA step over) a Qwen3 block-FP8 checkpoint with its linears dense in bf16 vs kept in FP8.

    python benchmarks/bench_fp8_load.py [--layers 8] [--hidden 1024] [--head-dim 128] [--device cpu|cuda] [--no-step]
    python benchmarks/bench_fp8_load.py --experts 32   # Qwen3-MoE's shape: 32 experts of --expert-intermediate 256

Writes a Qwen3-``FP8``-shaped checkpoint scaled down to fit a CPU (hidden 1024, intermediate 3072, 16 heads of 128,
8 KV heads, 8 layers by default; with ``--experts`` a Qwen3-MoE one, its experts one key each as released): the
release's layout, each attention, MLP and expert projection as random ``float8_e4m3fn`` bytes with a random
``weight_scale_inv`` per block of ``--block`` (128 x 128), the rest random bf16. Then, each in a fresh process, as recipes/lora_finetune.py does it (meta build, LoRA on q/k/v/o,
``load_into`` in bf16, every parameter read once):

  bf16    the linears dequantized to dense bf16 as they load (quantize_base: null)
  fp8     the linears (and experts) kept in FP8 (quantize_base: fp8): the file's bytes and scales, copied as each
          is read

and, unless ``--no-step``, one LoRA training step (forward, backward, AdamW; median of ``--steps``) over the loaded
model. Peak RSS is VmHWM over the measured part, the runtime's own resident memory (the imports) reported apart; on
a GPU (``--device cuda``) the model lives there and the figures are ``torch.cuda.max_memory_allocated``. Prints
the figures side by side; never asserts anything about them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks.bench_support (after the installed packages)
from benchmarks.bench_support import held_bytes, load_lora_model, lora_step, print_table, run_children  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "output_proj"]


def hf_config(args) -> dict:
    moe = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=args.experts,
               num_experts_per_tok=min(8, args.experts), moe_intermediate_size=args.expert_intermediate,
               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True) if args.experts else {}
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads // 2, "head_dim": args.head_dim, "vocab_size": args.vocab,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": list(args.block)}, **moe}


def build_checkpoint(path: Path, args) -> dict:
    """The release's keys and shapes (the family's converter run over a meta model), filled with random bytes, one
    safetensors file per layer. Returns the bytes written by kind."""
    import torch
    from safetensors.torch import save_file

    from waypoint.families import family_of, model_args_from_hf_config
    from waypoint.models import Transformer

    cfg = hf_config(args)
    margs = model_args_from_hf_config(cfg)
    with torch.device("meta"):
        native = Transformer(margs).state_dict()
    shapes = {k: (t.shape, t.dtype) for k, t in family_of(cfg).converter(margs).from_native(native).items()}
    gen = torch.Generator().manual_seed(0)
    path.mkdir(parents=True)
    sizes, index, files = {"fp8": 0, "other": 0}, {}, {}
    for key, (shape, _) in shapes.items():
        layer = key.split(".")[2] if key.startswith("model.layers.") else "rest"
        tensors = files.setdefault(f"model-{layer}.safetensors", {})
        if key.endswith("_proj.weight"):
            tensors[key] = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            grid = tuple(math.ceil(n / b) for n, b in zip(shape, args.block))
            tensors[key + "_scale_inv"] = torch.rand(grid, generator=gen) * 2e-4
            sizes["fp8"] += tensors[key].numel() + tensors[key + "_scale_inv"].numel() * 4
        else:
            tensors[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            sizes["other"] += tensors[key].numel() * 2
    for name, tensors in files.items():
        save_file(tensors, path / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (path / "config.json").write_text(json.dumps(cfg))
    return sizes


def child(kind: str, ckpt: Path, device: str, steps: int, seq_len: int) -> dict:
    from waypoint.models.fp8_weight import FP8Weight

    model, out = load_lora_model(ckpt, device, TARGETS, "fp8" if kind == "fp8" else None)
    linears = [p for n, p in model.named_parameters()
               if n.endswith(("_proj.weight", "w1.weight", "w2.weight", "w3.weight", "moe.w1", "moe.w2", "moe.w3"))]
    out["linears_gb"] = sum(held_bytes(p) for p in linears) / 1e9
    out["exact"] = sum(isinstance(p, FP8Weight) and p.from_file for p in linears)
    if steps:
        out.update(lora_step(model, device, steps, seq_len))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128))
    parser.add_argument("--experts", type=int, default=0, help="0: dense Qwen3; N: Qwen3-MoE with N experts")
    parser.add_argument("--expert-intermediate", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--no-step", action="store_true", help="measure the loads only")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = 0 if args.no_step else args.steps
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), args.device, steps, args.seq_len)))
        return
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_fp8_") as work:
        ckpt = Path(work) / "ckpt"
        sizes = build_checkpoint(ckpt, args)
        shape = (f"Qwen3-MoE shape, {args.experts} experts of {args.expert_intermediate}" if args.experts else
                 f"Qwen3 shape, intermediate {args.intermediate}")
        print(f"checkpoint: {shape}, hidden {args.hidden}, {args.heads} heads of "
              f"{args.head_dim}, {args.layers} layers: {sizes['fp8'] / 1e9:.3f} GB block FP8 ({list(args.block)}) + "
              f"{sizes['other'] / 1e9:.3f} GB bf16; LoRA on {', '.join(TARGETS)}; {args.device}")
        got = run_children(__file__, ("bf16", "fp8"), ckpt, ["--device", args.device, "--steps", str(steps),
                                                           "--seq-len", str(args.seq_len)])
        for line in got["fp8"].pop("lines") + got["bf16"].pop("lines"):
            print(line)
        cuda = args.device.startswith("cuda")
        print_table("linears", got, ("linears GB", "linears_gb"), cuda, steps)
        dense, held = got["bf16"], got["fp8"]
        peak = "load_gpu_gb" if cuda else "load_rss_gb"
        print(f"fp8 / bf16: linears held {held['linears_gb'] / dense['linears_gb']:.3f}x ({held['exact']} as the file's "
              f"bytes), all parameters {held['held_gb'] / dense['held_gb']:.3f}x, load peak {held[peak] / dense[peak]:.3f}x "
              f"({'GPU allocated' if cuda else 'RSS over the runtime'})"
              + (f", step time {held['step_s'] / dense['step_s']:.2f}x" if steps else ""))
        print(json.dumps({"sizes": sizes, **{f"{k}_{m}": v for k, r in got.items() for m, v in r.items()}}))


if __name__ == "__main__":
    main()
