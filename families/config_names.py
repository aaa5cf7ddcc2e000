"""Errors about a config.json in its own names: ModelArgs checks its fields by their native names (``n_layers``,
``kv_shared_layers``), which a native checkpoint's ``model.json`` uses; a model read from an HF config.json is refused
by the names that file has (``num_hidden_layers``, ``num_kv_shared_layers``). :func:`in_config_names` renames them in a
message, taking for a field several families name differently the name the config itself holds."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# native field -> its config.json names (the first one the config holds, else the first); dotted: within that field
NAMES: dict[str, tuple[str, ...]] = {
    "n_layers": ("num_hidden_layers",), "n_heads": ("num_attention_heads",), "n_kv_heads": ("num_key_value_heads",),
    "hidden_dim": ("intermediate_size",), "max_seq_len": ("max_position_embeddings",), "norm_eps": ("rms_norm_eps",),
    "tie_embeddings": ("tie_word_embeddings",), "final_softcap": ("final_logit_softcapping",),
    "attn_softcap": ("attn_logit_softcapping",), "local_rope_theta": ("rope_local_base_freq", "rope_parameters"),
    "rope_factor": ("rope_scaling.factor", "rope_parameters.factor"),
    "rope_beta_fast": ("rope_scaling.beta_fast", "rope_parameters.beta_fast"),
    "rope_beta_slow": ("rope_scaling.beta_slow", "rope_parameters.beta_slow"),
    "rope_original_max_seq_len": ("rope_scaling.original_max_position_embeddings",
                                  "rope_parameters.original_max_position_embeddings"),
    "rope_attention_factor": ("rope_scaling.attention_factor", "rope_parameters.attention_factor"),
    "rope_proportion": ("partial_rotary_factor",),
    "n_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok", "top_k_experts"), "expert_hidden_dim": ("moe_intermediate_size",),
    "shared_expert_hidden_dim": ("shared_expert_intermediate_size", "n_shared_experts"),
    "expert_groups": ("n_group",), "topk_groups": ("topk_group",), "routed_scaling": ("routed_scaling_factor",),
    "kv_shared_layers": ("num_kv_shared_layers",), "global_kv_heads": ("num_global_key_value_heads",),
    "per_layer_dim": ("hidden_size_per_layer_input",), "moe_beside_mlp": ("enable_moe_block",),
    "linear_key_heads": ("linear_num_key_heads",), "linear_value_heads": ("linear_num_value_heads",),
    "linear_conv_kernel": ("linear_conv_kernel_dim",), "linear_attention_layers": ("layer_types",),
}
_NATIVE = re.compile(r"\b(" + "|".join(sorted(NAMES, key=len, reverse=True)) + r")\b")


def config_name(native: str, config: Mapping[str, Any]) -> str:
    """The config.json name of a native field: the first of its names whose (top-level) field ``config`` holds."""
    names = NAMES.get(native, (native,))
    return next((name for name in names if name.split(".")[0] in config), names[0])


def in_config_names(message: str, config: Mapping[str, Any]) -> str:
    """``message`` with every native field name in it replaced by ``config``'s name for it."""
    return _NATIVE.sub(lambda m: config_name(m.group(1), config), message)
