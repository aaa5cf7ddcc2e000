"""Shared test helpers: tiny real HF checkpoints written by transformers itself."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Where the environment says PYTHONDONTWRITEBYTECODE=1 (this CI machine does), every process of the suite (3 workers,
# the runs they fork and start, torchrun's ranks) compiled the checkout's modules again, and each worker rewrote
# every test module's asserts again (8 of its 16 CPU-s of collection). Bytecode goes where Python puts it by default:
# __pycache__ beside the sources, which git ignores. Loaded before xdist starts its workers: they inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# tests/with_vllm/ run in vLLM's own environment (tests/test_vllm_environment.py runs them there)
collect_ignore = [] if __import__("importlib.util").util.find_spec("vllm") else ["with_vllm"]
# modules of one long test that start the run: collected last, it would leave the other xdist worker idle at the end
FIRST = ("test_vllm_environment.py",)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: every other test keeps its place
    for item in items:
        share_the_modules_fixtures(item)


def share_the_modules_fixtures(item) -> None:
    """A test that uses a module- or class-scoped fixture of its own module (a run the module's tests read) joins the
    module's xdist group: the fixture is made once, on one worker, not once on each worker that runs one of those
    tests (`--dist loadgroup` spreads every other test one by one). A test already in a group keeps it."""
    if item.get_closest_marker("xdist_group") is not None or not hasattr(item, "_fixtureinfo"):
        return
    module = item.nodeid.split("::")[0]
    definitions = item._fixtureinfo.name2fixturedefs
    if any(d.scope in ("module", "class") and d.baseid == module for name in item.fixturenames for d in definitions.get(name, ())):
        item.add_marker(pytest.mark.xdist_group(module.rpartition("/")[2].removesuffix(".py")))

# TRL's trainers take 12-25 s to import: the tests that use them as oracles share one xdist worker (`--dist
# loadgroup`, pyproject's addopts), so the suite pays that import once.
TRL_ORACLE = pytest.mark.xdist_group("trl")


def needs(*packages: str) -> pytest.MarkDecorator:
    """Skip where a package is not installed, without importing it while the suite is collected (in every xdist
    worker: peft takes 8 s, MLflow 3 s), as a module-level ``pytest.importorskip`` would."""
    import importlib.util

    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed")
# Likewise lm-evaluation-harness's task index (every task's YAML read once a process), and MLflow's and W&B's imports.
LM_EVAL = pytest.mark.xdist_group("lm_eval")
TRACKERS = pytest.mark.xdist_group("trackers")

# Where the tests that compare our models with transformers' compute: the CPU, or `WAYPOINT_TEST_DEVICE=cuda` on a GPU
# machine (the same tolerances). fp32 there is fp32: TF32 off for matrix products and for cuDNN's convolutions, whose
# default is on (it rounded transformers' Qwen3.5 Conv3d patch embedding to 10 mantissa bits: 2.9e-3 off ours, a
# Linear, on an H200). `WAYPOINT_TEST_TF32=1` leaves PyTorch's defaults, to measure that.
TEST_DEVICE = torch.device(os.environ.get("WAYPOINT_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type == "cuda" and os.environ.get("WAYPOINT_TEST_TF32") != "1":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def on_test_device(*items):
    """Modules, tensors or dicts of tensors moved to TEST_DEVICE (one item: itself, else a tuple)."""
    moved = tuple({k: v.to(TEST_DEVICE) for k, v in x.items()} if isinstance(x, dict) else x.to(TEST_DEVICE) for x in items)
    return moved[0] if len(moved) == 1 else moved


if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 3`: each worker one thread (and its children): 3 on 2 cores (README)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def tiny_llama_config(n_heads=4, n_kv_heads=2, head_dim=None, hidden=64, layers=2, vocab=128, tie=False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                       num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
                       max_position_embeddings=128, tie_word_embeddings=tie, rms_norm_eps=1e-5)


def write_hf_checkpoint(path: Path, config, fmt: str = "safetensors", max_shard_size: str = "60KB", seed: int = 0):
    """A random LlamaForCausalLM saved by ``save_pretrained`` into shards; ``fmt='bin'`` re-writes
    each shard as ``pytorch_model-*.bin`` with ``pytorch_model.bin.index.json`` (transformers v5 writes
    only safetensors). Returns the transformers model (eval mode)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, max_shard_size=max_shard_size)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    if fmt == "bin":
        index_path = path / "model.safetensors.index.json"
        if index_path.exists():
            index = json.loads(index_path.read_text())
            names = {f: f.replace("model", "pytorch_model", 1).replace(".safetensors", ".bin") for f in set(index["weight_map"].values())}
            for old, new in names.items():
                torch.save(load_file(path / old), path / new)
                (path / old).unlink()
            index["weight_map"] = {k: names[f] for k, f in index["weight_map"].items()}
            (path / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
            index_path.unlink()
        else:
            torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
            (path / "model.safetensors").unlink()
    return model


def sigterm_at_step(step: int | None) -> contextlib.AbstractContextManager:
    """Within the block, this process gets SIGTERM right after optimizer step ``step`` is logged: a preemption
    arriving mid-run, for recipes run in process (``main([...])``). None: no signal. (``tests/faults.py``)"""
    from tests.faults import injected

    return injected(None if step is None else ["signal-at-step", str(step), "SIGTERM"])


def save_adapter(directory: Path, model, converter, base_model_name_or_path: str, max_lora_rank: int = 16) -> Path:
    """``model``'s LoRA adapter in PEFT's format as a new directory, written as a LoRA step writes it
    (``write_adapter`` into a staged directory, committed with its manifest)."""
    from waypoint.checkpointers.commit import StagedDir
    from waypoint.checkpointers.peft_adapter import write_adapter

    with StagedDir(directory) as stage:
        write_adapter(stage, model, converter, base_model_name_or_path, max_lora_rank)
    return Path(directory)


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(7))


# -- other families (tests/test_families.py) ------------------------------------------------------------------

HYBRID = dict(head_dim=16, num_hidden_layers=3, max_position_embeddings=512, linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4)


def tiny_family_config(family: str, **overrides):
    """A tiny transformers config of ``family`` (``specific`` below): 2 layers, GQA, 128 vocab, 128 positions;
    ``overrides`` replace any field."""
    import transformers

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    specific = {
        "llama": ("LlamaConfig", {}),
        "llama31": ("LlamaConfig", dict(rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
        "mistral": ("MistralConfig", dict(sliding_window=5)),
        "qwen2": ("Qwen2Config", {}),
        "gemma": ("GemmaConfig", dict(head_dim=24, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh")),
        "phi3": ("Phi3Config", dict(pad_token_id=0)),
        "llama32": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
        "mistral_nemo": ("MistralConfig", dict(head_dim=24, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "phi4": ("Phi3Config", dict(pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 250000.0})),
        "qwen3": ("Qwen3Config", dict(head_dim=24, num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
        "gemma2": ("Gemma2Config", dict(head_dim=24, tie_word_embeddings=True, num_hidden_layers=3, query_pre_attn_scalar=12, sliding_window=4,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
        "gemma3": ("Gemma3TextConfig", dict(
            head_dim=24, tie_word_embeddings=True, num_hidden_layers=3, query_pre_attn_scalar=12, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
        "qwen2_moe": ("Qwen2MoeConfig", dict(head_dim=24, num_hidden_layers=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                             num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])),
        "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=24, num_hidden_layers=3, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
        # intermediate 32 and hidden 64: whole MXFP4 blocks of 32 along both experts' input dims; the published yarn
        # parameters with a short original context, so the ramp between frequencies matters over a few tokens
        "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=4, rope_parameters={
                                             "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})),
        # latent attention (q compressed: q_lora_rank), the first layer dense, 8 experts in 4 groups of which the best 2 are
        # searched for the top 3, 2 shared experts, YaRN with mscale != mscale_all_dim (the cos/sin and the softmax scaled)
        "deepseek_v3": ("DeepseekV3Config", dict(
            num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8})),
        # V2-Lite's shape: one q_proj (no q_lora_rank), greedy top-k of a softmax, 2 shared experts
        "deepseek_v2": ("DeepseekV2Config", dict(
            num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=3, n_shared_experts=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12, topk_method="greedy")),
        # hybrid Gated DeltaNet + gated attention: linear layers around a full one, 2 key heads serving 4 value heads,
        # RoPE on a quarter of each head (4 of 16 dims)
        "qwen3_5": ("Qwen3_5TextConfig", dict(HYBRID, layer_types=["linear_attention", "full_attention", "linear_attention"])),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(HYBRID, layer_types=["linear_attention", "full_attention", "linear_attention"],
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                                                     num_experts_per_tok=2)),
        "qwen3_next": ("Qwen3NextConfig", dict(HYBRID, layer_types=["linear_attention", "full_attention", "linear_attention"],
                                               moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                                               num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2])),
        # Gemma 4: sliding layers (head_dim 16) around full ones with their own head width and k/v heads and proportional
        # RoPE; no per-layer embeddings unless asked (Gemma4TextConfig's default is 256 per layer)
        "gemma4": ("Gemma4TextConfig", dict(
            head_dim=16, global_head_dim=32, tie_word_embeddings=True, num_hidden_layers=6, sliding_window=4, rms_norm_eps=1e-6,
            final_logit_softcapping=30.0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=128,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention",
                         "full_attention"])),
    }
    class_name, fields = specific[family]
    return getattr(transformers, class_name)(**{**common, **fields, **overrides})


def write_family_checkpoint(path: Path, config, max_shard_size: str = "40KB", seed: int = 0, packed: bool = False):
    """A random ``<Family>ForCausalLM`` for ``config`` saved by ``save_pretrained`` into shards. Every parameter is
    perturbed (norm weights and biases too, which transformers initialises to constants), so that RoPE
    permutations of biases and Gemma's (1 + weight) norms are exercised. Returns the model (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.1)
    # packed: MoE experts in transformers' own layout (gate_up_proj [E, 2I, H]) rather than the hub's per-expert keys
    model.save_pretrained(path, max_shard_size=max_shard_size, save_original_format=not packed)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return model


MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]  # the releases'


def write_mxfp4_checkpoint(path: Path, config, seed: int = 0, max_shard_size: str = "40KB"):
    """A gpt-oss checkpoint shaped like the releases: ``write_family_checkpoint``'s, its experts replaced by random
    MXFP4 ``*_blocks`` / ``*_scales`` (in the files the dense experts were in) and ``quantization_config`` in
    config.json. The bytes are random, not made by any quantizer, so no rounding of ours is assumed. Returns the
    transformers model that reads it (``Mxfp4Config(dequantize=True)``: the oracle), in fp32."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    write_family_checkpoint(path, config, max_shard_size=max_shard_size, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / name)
        for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            dense = tensors.pop(key)  # [E, in, out]: blocks of 32 along "in", one row per output
            experts, inputs, outputs = dense.shape
            tensors[key + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8,
                                                     generator=generator)
            tensors[key + "_scales"] = torch.randint(119, 125, (experts, outputs, inputs // 32), dtype=torch.uint8,
                                                     generator=generator)
            del index["weight_map"][key]
            index["weight_map"].update({key + "_blocks": name, key + "_scales": name})
        save_file(tensors, path / name, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    config_path = path / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED}
    config_path.write_text(json.dumps(config_json, indent=2))
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    return model.eval()


def write_fp8_checkpoint(path: Path, config, block=(32, 32), seed: int = 0, max_shard_size: str = "40KB", packed: bool = False):
    """A checkpoint shaped like a block-FP8 release (Qwen3 ``-FP8``, DeepSeek-V3): ``write_family_checkpoint``'s, each
    attention and MLP projection weight (experts' included, one key each or ``packed``) replaced by random
    ``float8_e4m3fn`` values and a random ``weight_scale_inv`` per ``block`` (in the same file), and
    ``quantization_config`` in config.json; embeddings, norms, router and head stay as they were. The bytes are random, not made by any quantizer. Returns the
    transformers model that reads it (``FineGrainedFP8Config(dequantize=True)``: the oracle), in fp32."""
    import math

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    write_family_checkpoint(path, config, max_shard_size=max_shard_size, seed=seed, packed=packed)
    generator = torch.Generator().manual_seed(seed + 1)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / name)
        for key in [k for k in tensors if k.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj"))
                    and ".mlp.gate." not in k]:
            *lead, rows, cols = tensors[key].shape  # [E, rows, cols] for packed experts
            values = torch.randn(*lead, rows, cols, generator=generator) * 100  # over e4m3's range (saturating at 448)
            tensors[key] = values.clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = key + "_scale_inv"  # X.weight_scale_inv; beside packed experts X_scale_inv (transformers' names)
            tensors[scale] = torch.rand(*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]), generator=generator) * 2e-3
            index["weight_map"][scale] = name
        save_file(tensors, path / name, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    mark_fp8(path, block)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                 dtype=torch.float32)
    return model.eval()


def write_encoded_fp8_checkpoint(path: Path, config, block=(128, 128), scale_dtype=torch.float32, seed: int = 0,
                                 max_shard_size: str = "40KB"):
    """A block-FP8 checkpoint encoded as DeepSeek's and Qwen's releases are: ``write_family_checkpoint``'s, each
    attention and MLP projection weight ``w`` given ``weight_scale_inv = amax / 448`` per block (in fp32, stored in
    ``scale_dtype``: the releases store float32 or bfloat16) and the weight ``(w / scale_inv).to(float8_e4m3fn)``;
    the other tensors and ``dtype`` in config.json follow ``config``'s dtype (bf16 configs: bf16 files, as the
    releases). Not our quantizer's rounding (``448 / amax`` then its inverse). Returns nothing."""
    import math

    from safetensors.torch import load_file, save_file

    write_family_checkpoint(path, config, max_shard_size=max_shard_size, seed=seed)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dense = torch.bfloat16 if str(getattr(config, "dtype", None) or "").endswith("bfloat16") else None
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / name)
        for key in [k for k in tensors if k.endswith("_proj.weight")]:
            w = tensors[key].float()
            rows, cols = w.shape
            gr, gc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
            blocks = torch.nn.functional.pad(w, (0, gc * block[1] - cols, 0, gr * block[0] - rows)).view(gr, block[0], gc, block[1])
            scale_inv = (blocks.abs().amax(dim=(1, 3)) / 448).to(scale_dtype)
            expanded = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
            tensors[key] = (w / expanded).to(torch.float8_e4m3fn)
            tensors[key + "_scale_inv"] = scale_inv
            index["weight_map"][key + "_scale_inv"] = name
        if dense is not None:
            tensors = {k: t.to(dense) if t.dtype == torch.float32 and not k.endswith("_scale_inv") else t for k, t in tensors.items()}
        save_file(tensors, path / name, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    mark_fp8(path, block)


def mark_fp8(path: Path, block) -> None:
    """config.json of the checkpoint at ``path`` given a block-FP8 ``quantization_config`` as the releases have it."""
    config_path = path / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": list(block)}
    config_path.write_text(json.dumps(config_json, indent=2))


def pack_fp8_experts(source: Path, path: Path) -> None:
    """``source`` (a per-expert block-FP8 checkpoint: ``write_fp8_checkpoint``) rewritten at ``path`` with each
    layer's experts packed as transformers names them in memory: ``mlp.experts.gate_up_proj [E, 2I, H]`` (each
    expert's gate rows, then its up rows) and ``mlp.experts.down_proj [E, H, I]``, each beside ``<key>_scale_inv``
    (``[E, ...]`` block scales), in the file expert 0's gate was in. The same bytes and scales, so it reads as the
    per-expert release does (which transformers reads; it ignores packed FP8 scales, so it is no oracle here)."""
    import re

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    tensors = {name: load_file(path / name) for name in sorted(set(index["weight_map"].values()))}
    every = {k: t for file in tensors.values() for k, t in file.items()}
    layers = sorted({m.group(1) for k in every if (m := re.match(r"(model\.layers\.\d+\.mlp\.experts)\.0\.gate_proj\.weight$", k))})
    for layer in layers:
        count = sum(1 for k in every if re.match(re.escape(layer) + r"\.\d+\.gate_proj\.weight$", k))
        file = index["weight_map"][f"{layer}.0.gate_proj.weight"]
        packed = {}
        for suffix in ("weight", "weight_scale_inv"):
            cat = lambda e: torch.cat([every[f"{layer}.{e}.{p}_proj.{suffix}"].view(torch.uint8) if suffix == "weight" else  # noqa: E731
                                       every[f"{layer}.{e}.{p}_proj.{suffix}"] for p in ("gate", "up")])
            gate_up = torch.stack([cat(e) for e in range(count)])
            down = torch.stack([every[f"{layer}.{e}.down_proj.{suffix}"].view(torch.uint8) if suffix == "weight" else
                                every[f"{layer}.{e}.down_proj.{suffix}"] for e in range(count)])
            end = "" if suffix == "weight" else "_scale_inv"
            packed[f"{layer}.gate_up_proj{end}"] = gate_up.view(torch.float8_e4m3fn) if suffix == "weight" else gate_up
            packed[f"{layer}.down_proj{end}"] = down.view(torch.float8_e4m3fn) if suffix == "weight" else down
        for key in [k for k in index["weight_map"] if k.startswith(layer + ".")]:
            del tensors[index["weight_map"].pop(key)][key]
        tensors[file].update(packed)
        index["weight_map"].update(dict.fromkeys(packed, file))
    for name, file in tensors.items():
        if file:
            save_file(file, path / name, metadata={"format": "pt"})
        else:  # held only experts of a later layer: gone with them
            (path / name).unlink()
    index_path.write_text(json.dumps(index, indent=2))
