"""Qwen2-MoE beyond tests/test_families.py: the shared expert against transformers' sparse block, the config fields
a checkpoint may set (sliding layers, no qkv bias, decoder_sparse_step, norm_topk_prob), config.json written back,
and LoRA on the shared expert's and dense layers' linears against PEFT."""

from __future__ import annotations

import json

import pytest
import torch

from waypoint.checkpointers import HFCheckpointer, build_model, load_into, load_model
from waypoint.families import model_args_from_hf_config
from waypoint.families.qwen2_moe import FAMILY
from waypoint.models.moe import MoE, grouped_mm_supported
from waypoint.models.lora import apply_lora, merged_state
from waypoint.models.transformer import Transformer
from tests.conftest import save_adapter, tiny_family_config, write_family_checkpoint
from tests.test_lora import hf_weights

D, I, SHARED = 32, 24, 40


def hf_block(top_k: int, norm_topk_prob: bool):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=I, shared_expert_intermediate_size=SHARED, num_experts=8,
                            num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, experts_implementation="eager")
    block = Qwen2MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return block.eval()


def native_from_hf(hf, normalize: bool) -> MoE:
    block = MoE(D, I, 8, hf.gate.top_k, normalize_topk=normalize, shared_hidden_dim=SHARED, shared_gate=True)
    with torch.no_grad():
        block.router.weight.copy_(hf.gate.weight)
        block.w1.copy_(hf.experts.gate_up_proj[:, :I]), block.w3.copy_(hf.experts.gate_up_proj[:, I:])
        block.w2.copy_(hf.experts.down_proj)
        shared = hf.shared_expert
        block.shared.w1.weight.copy_(shared.gate_proj.weight), block.shared.w3.weight.copy_(shared.up_proj.weight)
        block.shared.w2.weight.copy_(shared.down_proj.weight)
        block.shared_gate.weight.copy_(hf.shared_expert_gate.weight)
    return block.to(hf.gate.weight.dtype)


@pytest.mark.parametrize("top_k,normalize", [(2, False), (4, True)])
def test_sparse_block_with_shared_expert_matches_transformers(top_k, normalize):
    hf = hf_block(top_k, normalize)
    ours = native_from_hf(hf, normalize)
    assert sorted(k for k in ours.state_dict() if "shared" in k) == [
        "shared.w1.weight", "shared.w2.weight", "shared.w3.weight", "shared_gate.weight"]
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        shared_part = torch.sigmoid(hf.shared_expert_gate(x)) * hf.shared_expert(x)
        assert shared_part.abs().max() > 0.01  # the shared expert counts
        for dtype in (torch.float32, torch.bfloat16):
            hf.to(dtype), ours.to(dtype)
            ref = hf(x.to(dtype))
            for impl in ("grouped", "padded", "loop"):
                if impl == "grouped" and not grouped_mm_supported("cpu", dtype):
                    continue
                ours.impl = impl
                out, logits = ours(x.to(dtype))
                assert out.dtype == dtype and logits.shape == (21, 8)
                if dtype == torch.float32:
                    assert (out - ref).abs().max() <= 1e-6, (impl, (out - ref).abs().max())
                else:
                    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-2)
    # without the gate (DeepSeek's shared experts): routed + shared, unscaled
    plain = MoE(D, I, 8, top_k, normalize_topk=normalize, shared_hidden_dim=SHARED)
    assert plain.shared_gate is None
    with torch.no_grad():
        routed = plain.state_dict()
        plain.shared = None
        only_routed, _ = plain(x)
    plain = MoE(D, I, 8, top_k, normalize_topk=normalize, shared_hidden_dim=SHARED)
    plain.load_state_dict(routed)
    with torch.no_grad():
        torch.testing.assert_close(plain(x)[0], only_routed + plain.shared(x.reshape(-1, D)).reshape(x.shape))


def test_init_weights_covers_the_shared_expert():
    torch.manual_seed(0)
    block = MoE(256, 64, 4, 2, shared_hidden_dim=512, shared_gate=True)
    block.init_weights(std=0.02, down_std=0.005)
    std = {name: float(p.detach().std()) for name, p in block.named_parameters()}
    assert abs(std["shared.w1.weight"] - 0.02) < 0.002 and abs(std["shared_gate.weight"] - 0.02) < 0.005
    assert abs(std["shared.w2.weight"] - 0.005) < 0.0005
    args = model_args_from_hf_config(tiny_family_config("qwen2_moe").to_dict())
    model = Transformer(args)
    model.init_weights(std=0.02)
    assert abs(float(model.layers[0].moe.shared.w2.weight.detach().std()) - 0.02 / (2 * args.n_layers) ** 0.5) < 0.002


CONFIGS = {  # name -> tiny_family_config overrides
    "sliding": dict(use_sliding_window=True, sliding_window=4, max_window_layers=3),  # layers 0 and 2 slide
    "no-qkv-bias-sparse-step-2": dict(qkv_bias=False, decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4),
    "norm-topk": dict(norm_topk_prob=True, num_experts_per_tok=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_fields_match_transformers_logits(name, tmp_path, tokens):
    config = tiny_family_config("qwen2_moe", **CONFIGS[name])
    hf_model = write_family_checkpoint(tmp_path / "in", config)
    args = model_args_from_hf_config(config.to_dict())
    if name == "sliding":
        assert (args.sliding_window, args.full_attention_layers) == (4, (1,))
        v4 = {k: v for k, v in config.to_dict().items() if k != "layer_types"}  # the default types, as Qwen2MoeConfig makes them
        assert model_args_from_hf_config(v4) == args
    if name.startswith("no-qkv"):
        assert (args.qkv_bias, args.dense_layers) == (False, (0, 2))
    model = load_model(tmp_path / "in").eval()
    with torch.no_grad():
        diff = (model(tokens) - hf_model(tokens).logits).abs().max().item()
    print(f"\nqwen2-moe {name}: max |native - transformers| logit = {diff:.3g}")
    assert diff <= 1e-5


@pytest.mark.parametrize("overrides", [{}, CONFIGS["sliding"], CONFIGS["no-qkv-bias-sparse-step-2"]])
def test_hf_config_reads_back_the_same_in_ours_and_transformers(overrides):
    from transformers import Qwen2MoeConfig

    config = tiny_family_config("qwen2_moe", **overrides)
    args = model_args_from_hf_config(config.to_dict())
    written = json.loads(json.dumps(FAMILY.hf_config(args)))
    assert model_args_from_hf_config(written) == args
    theirs = Qwen2MoeConfig(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert theirs.layer_types == config.layer_types and theirs.mlp_only_layers == list(args.dense_layers)
    assert model_args_from_hf_config(theirs.to_dict()) == args


def test_fields_a_config_leaves_out_take_the_family_defaults():
    from transformers import Qwen2MoeConfig

    required = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=32)
    assert model_args_from_hf_config({"model_type": "qwen2_moe", **required}) == \
        model_args_from_hf_config(Qwen2MoeConfig(**required).to_dict())


def test_lora_on_shared_expert_and_dense_mlp_matches_peft(tmp_path, tokens):
    """apply_lora on w1/w2/w3 adapts the shared experts' and the dense layer's linears (the routed experts are
    stacked parameters, not linears); the adapter we write is PEFT's: PeftModel.from_pretrained gives our logits."""
    from peft import PeftModel

    base = tmp_path / "base"
    hf_model = write_family_checkpoint(base, tiny_family_config("qwen2_moe"))
    checkpointer = HFCheckpointer(base, output_dir=tmp_path / "out")
    with torch.device("meta"):
        model = build_model(base)
    load_into(model, checkpointer.load_checkpoint()["model"])
    wrapped = apply_lora(model, ["q_proj", "v_proj", "w1", "w2", "w3"], 4, 8.0)
    assert {w for w in wrapped if ".moe." in w or ".mlp." in w} == {
        f"layers.{i}.{m}.{w}" for i, m in ((0, "moe.shared"), (1, "mlp"), (2, "moe.shared")) for w in ("w1", "w2", "w3")}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    adapter = save_adapter(tmp_path / "adapter", model, checkpointer.converter, str(base))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "q_proj", "up_proj", "v_proj"]
    peft_model = PeftModel.from_pretrained(hf_model, adapter).eval()
    adapted = {n.removesuffix(".lora_A.default.weight") for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert "base_model.model.model.layers.0.mlp.shared_expert.gate_proj" in adapted
    assert "base_model.model.model.layers.1.mlp.down_proj" in adapted and len(adapted) == 3 * 2 + 9
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), peft_model(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"\nqwen2-moe LoRA on shared expert + dense MLP vs PEFT: max |logits diff| = {diff:.3g}")
    assert diff <= 1e-5
    # our merge is PEFT's merge_and_unload, in the input's files
    merged = hf_weights(checkpointer.save_to({"model": merged_state(model)}, tmp_path / "merged"))
    peft_merged = peft_model.merge_and_unload().state_dict()
    common = merged.keys() & peft_merged.keys()
    assert "model.layers.2.mlp.shared_expert.down_proj.weight" in common and "model.layers.1.mlp.up_proj.weight" in common
    assert max((merged[k].float() - peft_merged[k].float()).abs().max().item() for k in common) <= 1e-6
