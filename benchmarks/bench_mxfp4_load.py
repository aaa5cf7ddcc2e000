"""Loading (and one LoRA step over) a gpt-oss MXFP4 checkpoint with its experts dense in bf16 vs kept in MXFP4.

    python benchmarks/bench_mxfp4_load.py [--layers 8] [--experts 32] [--hidden 512] [--device cpu|cuda] [--no-step]

Writes a gpt-oss-shaped checkpoint scaled down to fit a CPU (hidden 512, intermediate 512, 32 experts, 8 layers by
default): the release's layout, each expert projection as random MXFP4 ``*_blocks`` / ``*_scales`` bytes, the rest
random bf16. Then, each in a fresh process, as recipes/lora_finetune.py does it (meta build, LoRA on attention and
experts, ``load_into`` in bf16, every parameter read once):

  bf16    the experts dequantized to dense bf16 as they load (quantize_base: null)
  mxfp4   the experts kept in MXFP4 (quantize_base: mxfp4): each dense tensor quantized as it is read

and, unless ``--no-step``, one LoRA training step (forward, backward, AdamW; median of ``--steps``) over the loaded
model. Peak RSS is VmHWM over the measured part, the runtime's own resident memory (the imports) reported apart; on
a GPU (``--device cuda``) the model lives there and the figures are ``torch.cuda.max_memory_allocated``. Prints
the figures side by side; never asserts anything about them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks.bench_support (after the installed packages)
from benchmarks.bench_support import held_bytes, load_lora_model, lora_step, print_table, run_children  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "output_proj", "experts_gate_up", "experts_down"]
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def hf_config(args) -> dict:
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers, "num_local_experts": args.experts,
            "num_experts_per_tok": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "vocab_size": args.vocab, "max_position_embeddings": 4096, "sliding_window": 128, "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
            "router_aux_loss_coef": 0.001, "hidden_act": "silu", "torch_dtype": "bfloat16",
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}}


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
    converter = family_of(cfg).converter(margs)
    converter.variant = "mxfp4"
    shapes = {k: (t.shape, t.dtype) for k, t in converter.from_native(native).items()}
    gen = torch.Generator().manual_seed(0)
    path.mkdir(parents=True)
    sizes, index = {"packed": 0, "other": 0}, {}
    files: dict[str, dict] = {}
    for key, (shape, dtype) in shapes.items():
        layer = key.split(".")[2] if key.startswith("model.layers.") else "rest"
        if key.endswith("_blocks"):
            t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        elif key.endswith("_scales"):
            t = torch.randint(119, 125, shape, dtype=torch.uint8, generator=gen)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        sizes["packed" if t.dtype == torch.uint8 else "other"] += t.numel() * t.element_size()
        files.setdefault(f"model-{layer}.safetensors", {})[key] = t
    for name, tensors in files.items():
        save_file(tensors, path / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (path / "config.json").write_text(json.dumps(cfg))
    return sizes



def child(kind: str, ckpt: Path, device: str, steps: int, seq_len: int) -> dict:
    model, out = load_lora_model(ckpt, device, TARGETS, "mxfp4" if kind == "mxfp4" else None)
    out.pop("lines")
    experts = [p for n, p in model.named_parameters() if n.endswith(("moe.w1", "moe.w2", "moe.w3"))]
    out["experts_gb"] = sum(held_bytes(p) for p in experts) / 1e9
    if steps:
        out.update(lora_step(model, device, steps, seq_len))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512)
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
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_mxfp4_") as work:
        ckpt = Path(work) / "ckpt"
        sizes = build_checkpoint(ckpt, args)
        print(f"checkpoint: gpt-oss shape, hidden {args.hidden}, intermediate {args.intermediate}, {args.experts} experts, "
              f"{args.layers} layers: {sizes['packed'] / 1e9:.3f} GB MXFP4 experts + {sizes['other'] / 1e9:.3f} GB bf16; "
              f"LoRA on {', '.join(TARGETS)}; {args.device}")
        got = run_children(__file__, ("bf16", "mxfp4"), ckpt, ["--device", args.device, "--steps", str(steps),
                                                           "--seq-len", str(args.seq_len)])
        cuda = args.device.startswith("cuda")
        print_table("experts", got, ("experts GB", "experts_gb"), cuda, steps)
        dense, packed = got["bf16"], got["mxfp4"]
        peak = "load_gpu_gb" if cuda else "load_rss_gb"
        print(f"mxfp4 / bf16: experts held {packed['experts_gb'] / dense['experts_gb']:.3f}x, all parameters "
              f"{packed['held_gb'] / dense['held_gb']:.3f}x, load peak {packed[peak] / dense[peak]:.3f}x "
              f"({'GPU allocated' if cuda else 'RSS over the runtime'})"
              + (f", step time {packed['step_s'] / dense['step_s']:.2f}x" if steps else ""))
        print(json.dumps({"sizes": sizes, **{f"{k}_{m}": v for k, r in got.items() for m, v in r.items()}}))


if __name__ == "__main__":
    main()
