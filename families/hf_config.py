"""What families share about ``config.json``: reading its fields into ModelArgs and writing them back.

Read as transformers v5 reads them: ``rope_parameters`` (or v4's ``rope_theta``/``rope_scaling``), the
family's class defaults for fields a file leaves out, ``layer_types`` for sliding-window layers. A value the
native model cannot reproduce is a ValueError naming the field; checkpointers turn it into one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waypoint.models.args import ModelArgs

IGNORE = (r"(^|\.)rotary_emb\.inv_freq$",)
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}
SLIDING, FULL = "sliding_attention", "full_attention"


class HFConfig:
    """A config.json's fields over its family's defaults: ``cfg[key]`` is the file's value where the file has
    the key (``null`` included, as transformers reads it), else the default."""

    def __init__(self, config: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        self.raw, self.defaults = config, defaults

    def __contains__(self, key: str) -> bool:
        return key in self.raw or key in self.defaults

    def __getitem__(self, key: str) -> Any:
        return self.raw[key] if key in self.raw else self.defaults[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default


def rope_params(cfg: HFConfig, layer_type: str | None = None) -> dict[str, Any]:
    """One flat dict of RoPE parameters, as transformers v5 standardises them: v4's ``rope_scaling`` (which wins
    where both are given), else v5's ``rope_parameters`` (per layer type where ``layer_type`` is given), with
    v4's top-level ``rope_theta`` (and ``partial_rotary_factor``) filled in."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    per_type = params and all(isinstance(v, Mapping) for v in params.values())
    if per_type and layer_type is None:
        raise ValueError(f"per-layer-type rope parameters ({', '.join(params)}) are not supported")
    if per_type:
        params = dict(params.get(layer_type) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta") or 10000.0)
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    return params


def rope_args(cfg: HFConfig, max_seq_len: int, supported: tuple[str, ...], model_type: str,
              layer_type: str | None = None, partial_rotary: bool = False) -> dict[str, Any]:
    """ModelArgs' rope fields (``rope_theta``, ``rope_type`` and its scaling) for the config's rope parameters;
    ``partial_rotary``: the family rotates part of each head (``partial_rotary_factor``), else only all of it."""
    params = rope_params(cfg, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in supported:
        raise ValueError(f"rope type {rope_type!r} is not supported for model_type {model_type!r} "
                         f"(supported: {', '.join(supported)})")
    args: dict[str, Any] = dict(rope_theta=float(params["rope_theta"]), rope_type=rope_type)
    if rope_type == "proportional":  # Gemma 4: its partial_rotary_factor is the share of frequency pairs that turn
        return dict(args, rope_proportion=float(params.get("partial_rotary_factor", 1.0)),
                    rope_factor=float(params.get("factor", 1.0)))
    if partial_rotary:
        args["partial_rotary_factor"] = float(params.get("partial_rotary_factor", 1.0))
    elif float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported (only 1.0)")
    if rope_type == "linear":
        args.update(rope_factor=float(params["factor"]))
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
        if missing:
            raise ValueError(f"llama3 rope parameters lack {', '.join(missing)}")
        # transformers gives a top-level original_max_position_embeddings priority, then the rope dict's,
        # then max_position_embeddings
        original = cfg.raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_seq_len
        args.update(rope_factor=float(params["factor"]), rope_low_freq_factor=float(params["low_freq_factor"]),
                    rope_high_freq_factor=float(params["high_freq_factor"]), rope_original_max_seq_len=int(original))
    if rope_type == "yarn":
        args.update(yarn_args(cfg, params, max_seq_len, layer_type))
    return args


def yarn_args(cfg: HFConfig, params: dict[str, Any], max_seq_len: int, layer_type: str | None) -> dict[str, Any]:
    """YaRN's fields, each read as transformers' ``standardize_rope_params`` / ``_compute_yarn_parameters`` read it."""
    if "factor" not in params:  # transformers' validation requires the key (null: the ratio below)
        raise ValueError("yarn rope parameters lack factor")
    if layer_type is None:
        # a top-level original_max_position_embeddings has priority, then the rope dict's, then max_position_embeddings
        original = cfg.raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_seq_len
        truncate = params.get("truncate", True)  # null: not truncated, as transformers' `if truncate:` reads it
    else:
        # per-layer-type parameters (Gemma 3): transformers fills in max_position_embeddings only, and reads
        # truncate from the outer dict of layer types, where it never is: the ramp is always truncated
        original = params.get("original_max_position_embeddings") or max_seq_len
        truncate = True
    factor = params["factor"] if params["factor"] is not None else max_seq_len / original
    optional = {name: None if params.get(key) is None else float(params[key]) for name, key in (
        ("rope_attention_factor", "attention_factor"), ("rope_mscale", "mscale"), ("rope_mscale_all_dim", "mscale_all_dim"))}
    return dict(rope_factor=float(factor), rope_original_max_seq_len=int(original), rope_truncate=bool(truncate),
                rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1),
                **optional)


def layer_window_args(window: int | None, layer_types: list[str], n_layers: int) -> dict[str, Any]:
    """``sliding_window`` and the layers exempt from it, from one ``sliding_attention``/``full_attention`` per layer."""
    if len(layer_types) != n_layers or set(layer_types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the {n_layers} layers")
    full = tuple(i for i, t in enumerate(layer_types) if t == FULL)
    return dict(sliding_window=window, full_attention_layers=full) if window is not None and len(full) < n_layers else {}


def activation(cfg: HFConfig, key: str = "hidden_act") -> str:
    act = cfg.get(key)
    if act not in ACTIVATIONS:
        raise ValueError(f"{key}={act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def check_fixed(cfg: HFConfig, fixed: Mapping[str, Any], model_type: str) -> None:
    """Each field of ``fixed`` must have the value the native model reproduces (absent or null counts as it)."""
    for key, value in fixed.items():
        given = cfg.raw.get(key)
        if given is not None and given != value:
            shown = "true" if given is True else "false" if given is False else repr(given)
            raise ValueError(f"{key}={shown} is not supported for model_type {model_type!r}")


def common_args(cfg: HFConfig, model_type: str, rope_types: tuple[str, ...] = ("default", "linear", "llama3", "yarn"),
                rope_layer_type: str | None = None, partial_rotary: bool = False) -> dict[str, Any]:
    """The ModelArgs fields every family reads the same way (shapes, norm eps, positions, tying, rope, dropout);
    ``rope_layer_type``: whose rope parameters are the model's (Gemma 3 has per-layer-type ones)."""
    missing = [k for k in REQUIRED if k not in cfg.raw]
    if missing:
        raise KeyError(f"config.json lacks {', '.join(missing)}")
    n_heads = cfg["num_attention_heads"]
    max_seq_len = cfg.get("max_position_embeddings")
    return dict(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads, vocab_size=cfg["vocab_size"],
        hidden_dim=cfg["intermediate_size"], head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        norm_eps=cfg["rms_norm_eps"], max_seq_len=max_seq_len, tie_embeddings=bool(cfg.get("tie_word_embeddings")),
        attn_dropout=float(cfg.get("attention_dropout") or 0.0), activation=activation(cfg),
        **rope_args(cfg, max_seq_len, rope_types, model_type, rope_layer_type, partial_rotary),
    )


# -- ModelArgs -> config.json ------------------------------------------------------------------------------

def rope_fields(args: ModelArgs) -> dict[str, Any]:
    """v5's ``rope_parameters`` for the model's global rope (v4 readers take ``rope_theta`` too)."""
    params: dict[str, Any] = {"rope_type": args.rope_type, "rope_theta": args.rope_theta}
    if args.rope_type == "linear":
        params["factor"] = args.rope_factor
    if args.rope_type == "proportional":
        params["partial_rotary_factor"] = args.rope_proportion
        if args.rope_factor != 1.0:
            params["factor"] = args.rope_factor
    if args.rope_type == "llama3":
        params.update(factor=args.rope_factor, low_freq_factor=args.rope_low_freq_factor,
                      high_freq_factor=args.rope_high_freq_factor, original_max_position_embeddings=args.rope_original_max_seq_len)
    if args.rope_type == "yarn":
        params.update(factor=args.rope_factor, original_max_position_embeddings=args.rope_original_max_seq_len,
                      beta_fast=args.rope_beta_fast, beta_slow=args.rope_beta_slow, truncate=args.rope_truncate)
        params.update({key: value for key, value in (("attention_factor", args.rope_attention_factor), ("mscale", args.rope_mscale),
                                                     ("mscale_all_dim", args.rope_mscale_all_dim)) if value is not None})
    return params


def layer_types(args: ModelArgs) -> list[str]:
    return [SLIDING if args.sliding_window is not None and i not in args.full_attention_layers else FULL
            for i in range(args.n_layers)]


def common_fields(args: ModelArgs, family) -> dict[str, Any]:
    """The config.json fields every family writes the same way, from what the weights' shapes and ModelArgs say."""
    return {
        "architectures": [family.architecture], "model_type": family.hf_model_types[0], "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "num_hidden_layers": args.n_layers, "head_dim": args.resolved_head_dim, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "attention_dropout": args.attn_dropout, "rope_parameters": rope_fields(args), "rope_theta": args.rope_theta,
        **{k: v for k, v in family.fixed.items() if v is not None},
    }
