"""Rule pieces of transformers' ``*ForCausalLM`` key layout that families share (``model.layers.{i}.…``).

Native keys are Meta's layout (``layers.{i}.attn.q_proj.weight``, ``layers.{i}.mlp.w1.weight``, ...). The q and
k rows (weights, biases and per-head norm weights) go through the RoPE permutation: HF rotates the two halves
of each head, the native model interleaved pairs.
"""

from __future__ import annotations

from waypoint.converters.ops import RopePermute
from waypoint.converters.table import Rule
from waypoint.models.args import ModelArgs

LAYER, NATIVE = "model.layers.{i}.", "layers.{i}."


def q_permute(args: ModelArgs) -> RopePermute:
    return RopePermute(args.n_heads, args.resolved_head_dim)


def k_permute(args: ModelArgs) -> RopePermute:
    return RopePermute(args.n_kv_heads, args.resolved_head_dim)


def head_permute(args: ModelArgs) -> RopePermute:
    """A per-head norm's [head_dim] weight scales the head's elements, so it takes the head's row order."""
    return RopePermute(1, args.resolved_head_dim)


def outer_rules() -> list[Rule]:
    """Embedding, final norm and output head."""
    return [
        Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "output.weight"),
    ]


def norm_rules() -> list[Rule]:
    """Llama's two pre-norms (its ``post_attention_layernorm`` is the norm before the MLP)."""
    return [
        Rule(LAYER + "input_layernorm.weight", NATIVE + "sa_norm.weight"),
        Rule(LAYER + "post_attention_layernorm.weight", NATIVE + "mlp_norm.weight"),
    ]


def sandwich_norm_rules() -> list[Rule]:
    """Gemma 2/3: a norm before and after each of attention and MLP (``post_attention_layernorm`` is on the
    attention's output here)."""
    return [
        Rule(LAYER + "input_layernorm.weight", NATIVE + "sa_norm.weight"),
        Rule(LAYER + "post_attention_layernorm.weight", NATIVE + "post_attn_norm.weight"),
        Rule(LAYER + "pre_feedforward_layernorm.weight", NATIVE + "mlp_norm.weight"),
        Rule(LAYER + "post_feedforward_layernorm.weight", NATIVE + "post_mlp_norm.weight"),
    ]


def attention_rules(args: ModelArgs) -> list[Rule]:
    """Separate q/k/v/o projections; q and k rows go through the RoPE permutation."""
    return [
        Rule(LAYER + "self_attn.q_proj.weight", NATIVE + "attn.q_proj.weight", q_permute(args)),
        Rule(LAYER + "self_attn.k_proj.weight", NATIVE + "attn.k_proj.weight", k_permute(args)),
        Rule(LAYER + "self_attn.v_proj.weight", NATIVE + "attn.v_proj.weight"),
        Rule(LAYER + "self_attn.o_proj.weight", NATIVE + "attn.output_proj.weight"),
    ]


def qkv_bias_rules(args: ModelArgs) -> list[Rule]:
    """Qwen2's q/k/v biases: rows of the projections' outputs, so q and k take the same permutation."""
    return [
        Rule(LAYER + "self_attn.q_proj.bias", NATIVE + "attn.q_proj.bias", q_permute(args)),
        Rule(LAYER + "self_attn.k_proj.bias", NATIVE + "attn.k_proj.bias", k_permute(args)),
        Rule(LAYER + "self_attn.v_proj.bias", NATIVE + "attn.v_proj.bias"),
    ]


def qk_norm_rules(args: ModelArgs) -> list[Rule]:
    """Qwen3 / Gemma 3: per-head RMSNorm on q and k before RoPE."""
    return [
        Rule(LAYER + "self_attn.q_norm.weight", NATIVE + "attn.q_norm.weight", head_permute(args)),
        Rule(LAYER + "self_attn.k_norm.weight", NATIVE + "attn.k_norm.weight", head_permute(args)),
    ]


def mlp_rules(layer: str = LAYER) -> list[Rule]:
    return [
        Rule(layer + "mlp.gate_proj.weight", NATIVE + "mlp.w1.weight"),
        Rule(layer + "mlp.up_proj.weight", NATIVE + "mlp.w3.weight"),
        Rule(layer + "mlp.down_proj.weight", NATIVE + "mlp.w2.weight"),
    ]


def at(layers, rules: list[Rule]) -> list[Rule]:
    """``rules`` (``{i}`` patterns) for the listed layers only (a MoE model's dense layers, a hybrid's linear ones)."""
    return [Rule(tuple(k.replace("{i}", str(i)) for k in r.hf), tuple(k.replace("{i}", str(i)) for k in r.native), r.op)
            for i in layers for r in rules]


def llama_rules(args: ModelArgs) -> list[Rule]:
    return outer_rules() + norm_rules() + attention_rules(args) + mlp_rules()
