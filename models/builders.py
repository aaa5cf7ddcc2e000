"""Model builders: the published Llama-family shapes, and shapes read from an HF ``config.json``."""

from __future__ import annotations

import json
from dataclasses import replace
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from waypoint.models.transformer import ROPE_TYPES, ModelArgs, Transformer

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
DTYPE_NAMES = tuple(_DTYPES)  # what dtype options accept


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """'bf16' / 'bfloat16' / 'torch.bfloat16' / torch.bfloat16 -> torch.bfloat16; None stays None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def llama2_7b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, hidden_dim=11008, max_seq_len=4096))


def llama2_13b() -> Transformer:
    return Transformer(ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, hidden_dim=13824, max_seq_len=4096))


def llama2_70b() -> Transformer:
    return Transformer(ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, hidden_dim=28672, max_seq_len=4096))


def llama3_8b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=14336, rope_theta=500000.0, max_seq_len=8192))


def llama3_1_8b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=14336, rope_theta=500000.0,
                                 max_seq_len=131072, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                                 rope_high_freq_factor=4.0, rope_original_max_seq_len=8192))


def mistral_7b() -> Transformer:
    """Mistral-7B-v0.1 (v0.3: 32768 vocabulary, rope theta 1e6, no sliding window)."""
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, hidden_dim=14336, rope_theta=10000.0,
                                 max_seq_len=32768, sliding_window=4096))


def qwen2_7b() -> Transformer:
    return Transformer(ModelArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064, hidden_dim=18944, norm_eps=1e-6,
                                 rope_theta=1000000.0, max_seq_len=131072, qkv_bias=True))


def gemma_2b() -> Transformer:
    return Transformer(_gemma_args(dim=2048, n_layers=18, n_heads=8, n_kv_heads=1, hidden_dim=16384))


def gemma_7b() -> Transformer:
    return Transformer(_gemma_args(dim=3072, n_layers=28, n_heads=16, n_kv_heads=16, hidden_dim=24576))


def _gemma_args(**shape) -> ModelArgs:
    return ModelArgs(**shape, vocab_size=256000, head_dim=256, norm_eps=1e-6, max_seq_len=8192, tie_embeddings=True,
                     norm_plus_one=True, embedding_scale=shape["dim"] ** 0.5, activation="gelu_pytorch_tanh")


def phi3_mini_4k() -> Transformer:
    return Transformer(ModelArgs(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32064, hidden_dim=8192, norm_eps=1e-5,
                                 max_seq_len=4096, sliding_window=2047))


# -- HF config.json -> ModelArgs ------------------------------------------------------------------------------

# The HF model types the native model reproduces, with the defaults their transformers config classes use for
# fields a config.json leaves out (None: an old config without model_type, read with this module's historic
# Llama defaults).
_FAMILY_DEFAULTS: dict[str | None, dict[str, Any]] = {
    None: dict(rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu"),
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False, hidden_act="silu"),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=4096 * 32, tie_word_embeddings=False, hidden_act="silu",
                    num_key_value_heads=8, sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=32, sliding_window=4096, use_sliding_window=False, max_window_layers=28),
    "gemma": dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                  num_key_value_heads=16, head_dim=256),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
                 sliding_window=None),
}
HF_MODEL_TYPES = tuple(k for k in _FAMILY_DEFAULTS if k is not None)
_ROPE_TYPES_OF = {"phi3": ("default",)}  # the rest: every rope type the native model implements
# config flags that change the architecture of a family's transformers class in ways the native model does not have
_UNSUPPORTED_FLAGS = {None: ("attention_bias", "mlp_bias"), "llama": ("attention_bias", "mlp_bias"),
                      "gemma": ("attention_bias", "use_bidirectional_attention")}
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}


def _rope_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """One flat dict of RoPE parameters, the way transformers v5 standardises them: v4's ``rope_scaling`` (which
    wins where both are given), else v5's ``rope_parameters``, with v4's top-level ``rope_theta`` (and
    ``partial_rotary_factor``) filled in."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"per-layer-type rope parameters ({', '.join(params)}) are not supported")
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta") or 10000.0)
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return params


def _rope_args(config: Mapping[str, Any], model_type: str | None, max_seq_len: int) -> dict[str, Any]:
    params = _rope_params(config)
    rope_type = params["rope_type"]
    supported = _ROPE_TYPES_OF.get(model_type, ROPE_TYPES)
    if rope_type not in supported:
        raise ValueError(f"rope type {rope_type!r} is not supported for model_type {model_type or 'llama'!r} "
                         f"(supported: {', '.join(supported)})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported (only 1.0)")
    args: dict[str, Any] = dict(rope_theta=float(params["rope_theta"]), rope_type=rope_type)
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
        if missing:
            raise ValueError(f"llama3 rope parameters lack {', '.join(missing)}")
        # transformers gives a top-level original_max_position_embeddings priority, then the rope dict's,
        # then max_position_embeddings
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_seq_len
        args.update(rope_factor=float(params["factor"]), rope_low_freq_factor=float(params["low_freq_factor"]),
                    rope_high_freq_factor=float(params["high_freq_factor"]), rope_original_max_seq_len=int(original))
    return args


def _sliding_window_args(config: Mapping[str, Any], model_type: str | None, defaults: Mapping[str, Any],
                         n_layers: int) -> dict[str, Any]:
    if "sliding_window" not in defaults:  # Llama and Gemma have none
        return {}
    window = config.get("sliding_window", defaults["sliding_window"])
    if model_type != "qwen2":
        return dict(sliding_window=window)
    # Qwen2: the window applies only with use_sliding_window, to the layers layer_types marks as sliding
    # (without layer_types: the layers from max_window_layers on)
    if not config.get("use_sliding_window", defaults["use_sliding_window"]) or window is None:
        return {}
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers", defaults["max_window_layers"])
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the {n_layers} layers")
    full = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    return dict(sliding_window=window, full_attention_layers=full) if len(full) < n_layers else {}


def _activation(config: Mapping[str, Any], model_type: str | None, defaults: Mapping[str, Any]) -> str:
    act = config.get("hidden_act") or defaults["hidden_act"]
    if model_type == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # transformers' GemmaConfig: legacy "gelu" means the tanh approximation
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported (supported: {', '.join(_HF_ACTIVATIONS)})")
    return _HF_ACTIVATIONS[act]


def model_args_from_hf_config(config: Mapping[str, Any]) -> ModelArgs:
    """ModelArgs from the fields of an HF ``config.json`` of a supported family (``HF_MODEL_TYPES``).

    Reads transformers v5's ``rope_parameters`` and v4's ``rope_theta``/``rope_scaling``; a field the file
    leaves out takes the family's transformers default. What the native model cannot reproduce exactly (an
    unknown model_type, rope type or activation, attention/MLP biases Llama makes optional, ...) is a
    ValueError naming it.
    """
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    missing = [k for k in required if k not in config]
    if missing:
        raise KeyError(f"config.json lacks {', '.join(missing)}")
    model_type = config.get("model_type")
    if model_type not in _FAMILY_DEFAULTS:
        raise ValueError(f"unknown model_type {model_type!r}; known: {', '.join(HF_MODEL_TYPES)}")
    defaults = _FAMILY_DEFAULTS[model_type]
    for flag in _UNSUPPORTED_FLAGS.get(model_type, ()):
        if config.get(flag):
            raise ValueError(f"{flag}=true is not supported for model_type {model_type or 'llama'!r}")
    n_heads, n_layers = config["num_attention_heads"], config["num_hidden_layers"]
    max_seq_len = config.get("max_position_embeddings") or defaults["max_position_embeddings"]
    gemma = model_type == "gemma"
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", defaults.get("num_key_value_heads")) or n_heads,
        vocab_size=config["vocab_size"],
        hidden_dim=config["intermediate_size"],
        head_dim=config.get("head_dim") or defaults.get("head_dim") or config["hidden_size"] // n_heads,
        norm_eps=config.get("rms_norm_eps", defaults["rms_norm_eps"]),
        max_seq_len=max_seq_len,
        tie_embeddings=bool(config.get("tie_word_embeddings", defaults["tie_word_embeddings"])),
        attn_dropout=float(config.get("attention_dropout", 0.0) or 0.0),
        qkv_bias=model_type == "qwen2",
        norm_plus_one=gemma,
        embedding_scale=config["hidden_size"] ** 0.5 if gemma else 1.0,
        activation=_activation(config, model_type, defaults),
        resid_dropout=float(config.get("resid_pdrop", 0.0) or 0.0) if model_type == "phi3" else 0.0,
        **_rope_args(config, model_type, max_seq_len),
        **_sliding_window_args(config, model_type, defaults, n_layers),
    )


def hf_config_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The weights' dtype as recorded in config.json (``dtype`` in v5, ``torch_dtype`` before)."""
    return parse_dtype(config.get("dtype") or config.get("torch_dtype"))


def read_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    """A parsed HF config from a ``config.json`` path, its directory, or the dict itself."""
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    return json.loads(path.read_text())


def from_hf_config(config: Mapping[str, Any] | str | os.PathLike, attn_dropout: float | None = None) -> Transformer:
    """The model for an HF config; ``attn_dropout`` overrides the config's ``attention_dropout``."""
    args = model_args_from_hf_config(read_hf_config(config))
    if attn_dropout is not None:
        args = replace(args, attn_dropout=attn_dropout)
    return Transformer(args)
