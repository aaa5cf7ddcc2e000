"""DeepSeek-V2/V3 beyond tests/test_families.py's checks: the routers against transformers' own router modules on
random inputs (the chosen experts exact), the score-correction bias through a checkpoint, the latent attention's
softmax scale, cache and packing, config.json written back, LoRA on the latent projections against PEFT, and the
refusals."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from waypoint.checkpointers import CheckpointError, HFCheckpointer, load_model
from waypoint.families import family_named, model_args_from_hf_config
from waypoint.models import ModelArgs, Transformer
from waypoint.models.kv_cache import KVCache
from waypoint.models.mla import mla_scale
from waypoint.models.moe import MoE
from tests.conftest import save_adapter, tiny_family_config, write_family_checkpoint

TOL = 1e-5


def random_router(router, seed: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if bias:  # of the scores' order of magnitude, so that it changes which experts are chosen
            router.e_score_correction_bias.copy_(torch.rand(router.e_score_correction_bias.shape, generator=g) * 0.5)


def native_moe(config, hf_router, routing: str, groups: tuple[int, int], normalize: bool) -> MoE:
    moe = MoE(config.hidden_size, 8, config.n_routed_experts, config.num_experts_per_tok, normalize, routing=routing,
              groups=groups, routed_scaling=config.routed_scaling_factor, fp32_routing_weights=True)
    with torch.no_grad():
        moe.router.weight.copy_(hf_router.weight)
        if routing == "sigmoid_grouped":
            moe.router.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    return moe


def assert_same_routing(ours, theirs) -> None:
    """Logits and weights bitwise, the same experts per token (compared as sets, in expert order)."""
    (logits, weights, experts), (hf_logits, hf_weights, hf_experts) = ours, theirs
    assert torch.equal(logits, hf_logits)
    order, hf_order = experts.argsort(dim=-1), hf_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))


@pytest.mark.parametrize("n_group,topk_group,top_k,norm", [(8, 3, 6, True), (4, 1, 2, False), (1, 1, 8, True)])
def test_v3_routing_is_transformers_router_exactly(n_group, topk_group, top_k, norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=top_k, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    random_router(router, 0, bias=True)
    moe = native_moe(config, router, "sigmoid_grouped", (n_group, topk_group), norm)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_routing(moe.route(x), router(x))
        assert_same_routing(moe.route(x.bfloat16()), router(x.bfloat16()))  # fp32 logits from bf16 inputs, as transformers
        if n_group > 1:  # the groups and the bias both decide: without either, other experts for some tokens
            chosen = moe.route(x)[2].sort(dim=-1).values
            moe.groups = (1, 1)
            assert not torch.equal(moe.route(x)[2].sort(dim=-1).values, chosen)
            moe.groups = (n_group, topk_group)
            moe.router.e_score_correction_bias.zero_()
            assert not torch.equal(moe.route(x)[2].sort(dim=-1).values, chosen)


@pytest.mark.parametrize("method,n_group,topk_group", [("greedy", None, None), ("group_limited_greedy", 8, 3),
                                                       ("group_limited_greedy", 4, 1)])
def test_v2_routing_is_transformers_router_exactly(method, n_group, topk_group):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=6, n_group=n_group,
                              topk_group=topk_group, topk_method=method, routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(config)
    random_router(router, 2, bias=False)
    moe = native_moe(config, router, "softmax_grouped", (n_group or 1, topk_group or 1), False)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_same_routing(moe.route(x), router(x))


def test_replayed_routes_give_the_same_weights():
    from waypoint.models.moe import same_routing

    args = model_args_from_hf_config(tiny_family_config("deepseek_v3").to_dict())
    torch.manual_seed(0)
    model = Transformer(args).eval()
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), same_routing(model) as routes:
        expected = model(tokens)
    with torch.no_grad(), same_routing(model, routes):
        assert torch.equal(model(tokens), expected)


def test_score_correction_bias_loads_saves_and_is_transformers(tmp_path):
    """write_family_checkpoint randomises parameters only: here the buffer too, so that it moves the choice."""
    from transformers import AutoModelForCausalLM

    hf = write_family_checkpoint(tmp_path / "plain", tiny_family_config("deepseek_v3"))
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    hf.save_pretrained(tmp_path / "in", max_shard_size="40KB")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "in").eval()
    model = load_model(tmp_path / "in").eval()
    bias = model.layers[1].moe.router.e_score_correction_bias
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias) and bias.abs().sum() > 0
    assert "e_score_correction_bias" not in dict(model.named_parameters()) and not bias.requires_grad
    tokens = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
        unbiased = load_model(tmp_path / "plain").eval()
        moved = (unbiased(tokens) - model(tokens)).abs().max().item()
    print(f"\ndeepseek-v3 with a score-correction bias: max |native - transformers| logit = {diff:.3g}")
    assert diff <= TOL and moved > 1e-3


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 32},
                                  {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
                                  {"rope_type": "default", "rope_theta": 10000.0}])
def test_softmax_scale_is_transformers(rope):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    positions = int(rope.get("factor", 1) * rope.get("original_max_position_embeddings", 128))  # the ratio is the factor
    config = tiny_family_config("deepseek_v3", rope_parameters=rope, max_position_embeddings=positions)
    assert mla_scale(model_args_from_hf_config(config.to_dict())) == DeepseekV3Attention(config, 0).scaling


@pytest.mark.parametrize("name,overrides", [("deepseek_v3", {}), ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),
                                            ("deepseek_v2", {})])
def test_cached_steps_and_packed_documents_give_the_full_forward(name, overrides):
    args = model_args_from_hf_config(tiny_family_config(name, **overrides).to_dict())
    torch.manual_seed(0)
    model = Transformer(args).eval()
    tokens = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(len(model.layers))
        stepped = [model(tokens[:, :5], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(5, 11)]
        assert (torch.cat(stepped, dim=1) - full).abs().max().item() <= TOL
        assert tuple(cache.keys[0].shape) == (1, 1, 11, args.kv_lora_rank)  # the latent, not per-head keys
        second = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
        packed = model(torch.cat([tokens, second], dim=1), positions=torch.cat([torch.arange(11), torch.arange(6)])[None],
                       document_ids=torch.tensor([[0] * 11 + [1] * 6]))
        assert (packed[:, :11] - full).abs().max().item() <= TOL and (packed[:, 11:] - model(second)).abs().max().item() <= TOL


@pytest.mark.parametrize("name,overrides", [("deepseek_v3", {}), ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False,
                                                                                      n_group=1, topk_group=1)),
                                            ("deepseek_v2", {}), ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4,
                                                                                      topk_group=2, attention_bias=True))])
def test_config_json_written_back_reads_as_the_same_model(name, overrides):
    """For a native checkpoint without a source config: what hf_config writes is read back to the same ModelArgs,
    and transformers builds the same shapes from it."""
    import transformers

    config = tiny_family_config(name, **overrides)
    args = model_args_from_hf_config(config.to_dict())
    written = family_named(name).hf_config(args)
    assert model_args_from_hf_config(json.loads(json.dumps(written))) == args
    assert ModelArgs(**json.loads(json.dumps(dataclasses.asdict(args)))) == args
    rebuilt = getattr(transformers, type(config).__name__)(**{k: v for k, v in written.items() if k != "architectures"})
    theirs = {k: tuple(v.shape) for k, v in transformers.AutoModelForCausalLM.from_config(rebuilt).state_dict().items()}
    converter = family_named(name).converter(args)
    converter.variant = "packed"  # transformers' own layout in memory
    assert {k: tuple(v.shape) for k, v in converter.from_native(Transformer(args).state_dict()).items()} == theirs


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_fields_a_config_leaves_out_take_the_family_defaults(name):
    """A config.json with only the shapes gives what transformers builds from it (its class defaults)."""
    required = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_experts_per_tok=2)  # V2's class has no default number of experts per token
    full = type(tiny_family_config(name))(**required).to_dict()
    assert model_args_from_hf_config({"model_type": name, **required}) == model_args_from_hf_config(full)


def test_lora_on_the_latent_projections_is_peft(tmp_path):
    from peft import PeftModel

    from waypoint.models.lora import apply_lora

    hf_model = write_family_checkpoint(tmp_path / "base", tiny_family_config("deepseek_v3"))
    checkpointer = HFCheckpointer(tmp_path / "base", output_dir=tmp_path / "out")
    model = load_model(tmp_path / "base")
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]  # HF's names are accepted
    apply_lora(model, targets, rank=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM serves no LoRA on these modules: a warning, not this test's subject
        adapter = save_adapter(tmp_path / "adapter", model, checkpointer.converter, str(tmp_path / "base"))
    assert sorted(json.loads((adapter / "adapter_config.json").read_text())["target_modules"]) == sorted(
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
    tokens = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (model.eval()(tokens) - PeftModel.from_pretrained(hf_model, adapter).eval()(tokens).logits).abs().max().item()
    print(f"\ndeepseek-v3 LoRA on the latent projections vs PEFT: max |logits diff| = {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("name,field,value,message", [
    ("deepseek_v2", "topk_method", "noaux_tc", r"topk_method='noaux_tc' is not supported"),
    ("deepseek_v2", "mlp_bias", True, r"mlp_bias=true is not supported for model_type 'deepseek_v2'"),
    ("deepseek_v3", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, r"rope type 'linear'"),
])
def test_what_the_native_model_cannot_reproduce_is_one_line(name, field, value, message, tmp_path):
    config = {**tiny_family_config(name).to_dict(), field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"^config\.json: {message}") as e:
        HFCheckpointer(tmp_path, output_dir=tmp_path / "out")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad,message", [
    (dict(n_kv_heads=2), r"n_kv_heads=2 must be n_heads=4"),
    (dict(attn_sinks=True), r"attn_sinks not supported with latent attention"),
    (dict(kv_lora_rank=0), r"kv_lora_rank=0 must be positive"),
    (dict(expert_groups=3), r"expert_groups=3 must divide n_experts=8"),
    (dict(topk_groups=5), r"topk_groups=5 must be between 1 and expert_groups"),
    (dict(expert_groups=8, topk_groups=2), r"groups need 2 experts or more"),
])
def test_meaningless_values_are_refused(bad, message):
    args = model_args_from_hf_config(tiny_family_config("deepseek_v3").to_dict())
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(args, **bad)


def test_the_multi_token_prediction_layer_is_carried_untouched(tmp_path):
    """DeepSeek-V3's release has one more layer after the last (``num_nextn_predict_layers``): the native model does
    not run it, transformers ignores it, and every save writes it back in its file, byte for byte."""
    from safetensors.torch import load_file, save_file

    from waypoint.checkpointers import HFCheckpointer, load_model

    config = tiny_family_config("deepseek_v3")
    hf_model = write_family_checkpoint(tmp_path / "in", config)
    n = config.num_hidden_layers
    generator = torch.Generator().manual_seed(5)
    mtp = {f"model.layers.{n}.{key}": torch.randn(shape, generator=generator) for key, shape in (
        ("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128)), ("shared_head.norm.weight", (64,)))}
    index_path = tmp_path / "in" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    save_file({**load_file(tmp_path / "in" / last), **mtp}, tmp_path / "in" / last, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(mtp, last))
    index_path.write_text(json.dumps(index))
    config_path = tmp_path / "in" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "num_nextn_predict_layers": 1}))
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (load_model(tmp_path / "in").eval()(tokens) - hf_model(tokens).logits).abs().max().item() <= 1e-5
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()["model"]
    assert any(line.startswith(f"carried untouched: 4 tensors of layers the model does not run (model.layers.{n}.")
               for line in ckpt.notes)
    out = ckpt.save_checkpoint({"model": state}, step=1)
    written = load_file(out / last)
    assert all(torch.equal(written[k], t) for k, t in mtp.items())
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == index["weight_map"]


def test_the_score_correction_bias_keeps_its_dtype_in_a_bf16_model(tmp_path):
    """Loaded into a bf16 model the untrained bias stays in the checkpoint's fp32 (as transformers keeps it), so the
    selection is not rounded and a save writes it back byte for byte."""
    from safetensors.torch import load_file, save_file

    from waypoint.checkpointers import load_into
    from waypoint.checkpointers.file_formats import read_tensors

    write_family_checkpoint(tmp_path / "in", tiny_family_config("deepseek_v3"))
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    index = json.loads((tmp_path / "in" / "model.safetensors.index.json").read_text())["weight_map"]
    file = tmp_path / "in" / index[key]
    tensors = load_file(file)
    tensors[key] = torch.randn(tensors[key].shape, generator=torch.Generator().manual_seed(2)) * 1e-3 + 0.1
    save_file(tensors, file, metadata={"format": "pt"})
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()["model"]
    with torch.device("meta"):
        model = Transformer(ckpt.model_args())
    load_into(model, state, dtype=torch.bfloat16)
    bias = model.layers[1].moe.router.e_score_correction_bias
    assert bias.dtype == torch.float32 and model.layers[1].moe.router.weight.dtype == torch.bfloat16
    assert torch.equal(bias, tensors[key])
    out = ckpt.save_checkpoint({"model": model.state_dict()}, step=1)
    assert torch.equal(read_tensors(out / index[key])[key], tensors[key])
