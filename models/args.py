"""What the native model is: :class:`ModelArgs`, every family's architecture as fields whose defaults are Llama's,
and the activations a feed-forward (dense or expert) may use.

Its own module, below ``attention``, ``moe`` and ``transformer``, which all read it: none of them imports another
to learn what the model is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from functools import partial

import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,  # exact (erf) GELU
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
# "normed_softmax_topk": Gemma 4's (models.moe), the router's input RMS-normed and scaled, each expert's weight scaled
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "softmax_grouped", "normed_softmax_topk")
GROUPED_ROUTINGS = ("sigmoid_grouped", "softmax_grouped")  # DeepSeek-V3, DeepSeek-V2 (models.grouped_routing)
ROPE_TYPES = ("default", "llama3", "linear", "yarn", "proportional")


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attn_dropout: float = 0.0  # attention-probability dropout while training
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight), multiplied in fp32 (Gemma)
    embedding_scale: float = 1.0  # embeddings times this, cast to their dtype first (Gemma: sqrt(dim))
    activation: str = "silu"  # the gate's activation: silu, gelu, gelu_pytorch_tanh (Gemma)
    rope_type: str = "default"  # "default", "llama3" (Llama 3.1's frequency scaling, below), "linear" or "yarn"
    rope_factor: float = 8.0  # llama3, linear (frequencies / factor) and yarn
    # llama3 only:
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # llama3 and yarn: the context length before scaling
    # yarn only (transformers' beta_fast, beta_slow, truncate, attention_factor, mscale, mscale_all_dim):
    rope_beta_fast: float = 32.0  # the ramp between extrapolated and interpolated frequencies, in rotations
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True  # round the ramp's ends to whole dimensions (gpt-oss: False)
    rope_attention_factor: float | None = None  # cos and sin times this; None: from rope_factor (and the mscales)
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    sliding_window: int | None = None  # each query sees itself and the window - 1 tokens before it
    full_attention_layers: tuple[int, ...] = ()  # layers exempt from sliding_window (Qwen2's max_window_layers)
    resid_dropout: float = 0.0  # dropout on each block's attention and MLP outputs while training (Phi-3)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # attention scores -> tanh(s / cap) * cap before mask and softmax (Gemma 2)
    final_softcap: float | None = None  # logits -> tanh(l / cap) * cap (Gemma 2)
    sandwich_norms: bool = False  # post_attn_norm / post_mlp_norm on each block's outputs (Gemma 2, 3)
    local_rope_theta: float | None = None  # sliding layers' own unscaled RoPE base (Gemma 3)
    n_experts: int = 0  # mixture of experts: experts per MoE layer (0: every layer has the dense MLP)
    experts_per_token: int = 2  # top-k
    expert_hidden_dim: int | None = None  # an expert's width (None: hidden_dim; Qwen3-MoE's moe_intermediate_size)
    normalize_expert_weights: bool = True  # renormalise the top-k weights to sum 1 (Qwen3-MoE's norm_topk_prob)
    expert_weights_fp32: bool = False  # weigh expert outputs with fp32 routing weights (Mixtral) or cast first (Qwen3-MoE)
    dense_layers: tuple[int, ...] = ()  # layers keeping the dense MLP in a MoE model (Qwen3-MoE's mlp_only_layers)
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight in the training loss
    shared_expert_hidden_dim: int | None = None  # a dense gated MLP this wide on every token of each MoE layer (Qwen2-MoE)
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(Linear(dim, 1)(x)) (Qwen2-MoE)
    # gpt-oss:
    attn_sinks: bool = False  # a learned logit per head that joins each softmax's denominator
    attn_output_bias: bool = False  # a bias on the attention's output projection (gpt-oss's attention_bias)
    router_bias: bool = False  # a bias on the MoE router
    expert_bias: bool = False  # biases on each expert's projections
    routing: str = "softmax_topk"  # softmax over all experts, then top-k; "topk_softmax": softmax over the top-k logits
    swiglu_limit: float | None = None  # clamped SwiGLU: gate clamped above and up both sides at the limit,
    swiglu_alpha: float = 1.702  # then (up + 1) * gate * sigmoid(alpha * gate)
    # multi-head latent attention (DeepSeek V2/V3, models.mla), in place of Attention where kv_lora_rank is set; head_dim
    # is then the rotary part of each q/k head (transformers' qk_rope_head_dim, as its config's head_dim), n_kv_heads n_heads
    kv_lora_rank: int | None = None  # the compressed k/v latent's width
    q_lora_rank: int | None = None  # the compressed query's width (None: one q_proj)
    qk_nope_head_dim: int = 0  # each q/k head's dimensions without RoPE, before its head_dim rotary ones
    v_head_dim: int | None = None  # each value head's width (None: qk_nope_head_dim + head_dim)
    rope_interleave: bool = True  # the rotary rows in interleaved pairs (DeepSeek's); False: in halves (rotated as HF's)
    # DeepSeek routing (routing "sigmoid_grouped": V3, "softmax_grouped": V2): the experts in expert_groups groups, the
    # top-k chosen within the topk_groups best groups, the weights times routed_scaling
    expert_groups: int = 1  # n_group
    topk_groups: int = 1  # topk_group
    routed_scaling: float = 1.0  # routed_scaling_factor
    # hybrid models (Qwen3-Next, Qwen3.5/3.6): these layers mix tokens with Gated DeltaNet (models.gated_deltanet)
    # rather than attention; its heads and widths below. The attention layers' q_proj also emits a gate per head
    # (attn_output_gate) and rotates only the first partial_rotary_factor of each head
    linear_attention_layers: tuple[int, ...] = ()
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    attn_output_gate: bool = False  # q_proj emits [query, gate] per head; the output is times sigmoid(gate)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * this dims of each q/k head (the rest pass)
    # Gemma 4: the full-attention layers' own head width and k/v heads; rope_type "proportional" rotates the first
    # rope_proportion of each head's frequency pairs (at base ** (-2i / head_dim)) and leaves the others still
    global_head_dim: int | None = None  # None: head_dim
    global_kv_heads: int | None = None  # None: n_kv_heads
    rope_proportion: float = 1.0
    attn_k_eq_v: bool = False  # full-attention layers take their keys (before k_norm and RoPE) as values: no v_proj
    value_norm: bool = False  # a weightless RMSNorm over each value head
    kv_shared_layers: int = 0  # the last N layers attend over the keys and values of the last earlier layer of their type
    layer_scalar: bool = False  # each block's output times its own stored scalar (a buffer: in the checkpoint, not trained)
    norm_fp32_weight: bool = False  # RMSNorm multiplies by its weight in fp32, then casts (Gemma 4; Llama casts first)
    per_layer_dim: int = 0  # per-layer embeddings (models.per_layer_embeddings): each layer's width; 0: none
    per_layer_vocab_size: int | None = None  # their table's rows (None: vocab_size)
    moe_beside_mlp: bool = False  # every layer's experts run beside its dense MLP, each with its own norms, summed
    double_wide_mlp: bool = False  # the kv-shared layers' dense MLP is twice hidden_dim wide
    vision: Any = None  # a vision-language model's image side (models.vision_args.VisionArgs); None: text only
    mrope_section: tuple[int, ...] | None = None  # Qwen3.5's multimodal RoPE: frequencies per axis (models.mrope)

    @property
    def rotary_dim(self) -> int:
        """How many dims of each q/k head RoPE rotates (transformers' ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def __post_init__(self) -> None:
        # JSON round trips (asdict -> json -> ModelArgs(**)) turn tuples into lists
        object.__setattr__(self, "full_attention_layers", tuple(sorted(int(i) for i in self.full_attention_layers)))
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))
        object.__setattr__(self, "linear_attention_layers", tuple(sorted(int(i) for i in self.linear_attention_layers)))
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(int(n) for n in self.mrope_section))
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be between 1 and n_experts={self.n_experts}")
        if self.shared_expert_hidden_dim is not None and not self.shared_expert_hidden_dim > 0:
            raise ValueError(f"shared_expert_hidden_dim={self.shared_expert_hidden_dim} must be positive (or None)")
        if self.shared_expert_gate and self.shared_expert_hidden_dim is None:
            raise ValueError("shared_expert_gate scales a shared expert, but shared_expert_hidden_dim is None")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim} must be even for rotary embeddings")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.rope_type == "llama3" and self.rope_low_freq_factor >= self.rope_high_freq_factor:
            raise ValueError(f"llama3 rope needs low_freq_factor < high_freq_factor, got "
                             f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
        if self.rope_type != "default" and not self.rope_factor > 0:
            raise ValueError(f"rope_factor={self.rope_factor} must be positive")
        if self.rope_type == "yarn":
            for name in ("rope_beta_fast", "rope_beta_slow", "rope_original_max_seq_len"):
                if not getattr(self, name) > 0:  # also refuses NaN
                    raise ValueError(f"{name}={getattr(self, name)} must be positive for yarn rope")
            if self.rope_attention_factor is not None and not self.rope_attention_factor > 0:
                raise ValueError(f"rope_attention_factor={self.rope_attention_factor} must be positive (or None)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive (or None)")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # also refuses NaN
                raise ValueError(f"{name}={value} must be positive (or None)")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r} is not supported; supported: {', '.join(ROUTINGS)}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit={self.swiglu_limit} must be positive (or None)")
        if self.local_rope_theta is not None and self.sliding_window is None:
            raise ValueError("local_rope_theta is the sliding layers' RoPE base, but sliding_window is None")
        check_mla_and_groups(self)
        check_linear_attention(self)
        check_shared_kv(self)

    def is_full_attention(self, layer: int) -> bool:
        return self.sliding_window is None or layer in self.full_attention_layers

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """Layer ``layer``'s (k/v heads, head_dim): the full-attention layers' own where Gemma 4 sets them."""
        if self.is_full_attention(layer):
            return self.global_kv_heads or self.n_kv_heads, self.global_head_dim or self.resolved_head_dim
        return self.n_kv_heads, self.resolved_head_dim

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values layer ``layer`` attends over (``kv_shared_layers``), or None: its own."""
        first = self.n_layers - self.kv_shared_layers
        if layer < first:
            return None
        full = self.is_full_attention(layer)
        return max(i for i in range(first) if self.is_full_attention(i) == full)


def check_mla_and_groups(args: ModelArgs) -> None:
    """The latent attention's and the grouped routing's fields: shapes that fit together, and no feature of
    ``Attention`` that ``LatentAttention`` lacks."""
    if args.kv_lora_rank is not None:
        for name in ("kv_lora_rank", "q_lora_rank", "v_head_dim"):
            value = getattr(args, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be positive (or None)")
        if args.qk_nope_head_dim < 0:
            raise ValueError(f"qk_nope_head_dim={args.qk_nope_head_dim} must not be negative")
        if args.n_kv_heads != args.n_heads:
            raise ValueError(f"latent attention has a key and a value per head: n_kv_heads={args.n_kv_heads} must be n_heads={args.n_heads}")
        unsupported = [name for name in ("attn_sinks", "attn_softcap", "qk_norm") if getattr(args, name)]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} not supported with latent attention (kv_lora_rank)")
    if args.routing in GROUPED_ROUTINGS:
        if args.expert_groups < 1 or args.n_experts % args.expert_groups:
            raise ValueError(f"expert_groups={args.expert_groups} must divide n_experts={args.n_experts}")
        if not 1 <= args.topk_groups <= args.expert_groups:
            raise ValueError(f"topk_groups={args.topk_groups} must be between 1 and expert_groups={args.expert_groups}")
        if args.routing == "sigmoid_grouped" and args.expert_groups > 1 and args.n_experts // args.expert_groups < 2:
            raise ValueError("sigmoid_grouped scores each group by its top-2 experts: groups need 2 experts or more")
        if not args.routed_scaling > 0:
            raise ValueError(f"routed_scaling={args.routed_scaling} must be positive")


def check_shared_kv(args: ModelArgs) -> None:
    """Gemma 4's fields: each kv-shared layer has an earlier layer of its type to share with."""
    if args.kv_shared_layers and not 0 < args.kv_shared_layers < args.n_layers:
        raise ValueError(f"kv_shared_layers={args.kv_shared_layers} must be 0, or less than n_layers={args.n_layers}")
    first = args.n_layers - args.kv_shared_layers
    kinds = {args.is_full_attention(i) for i in range(first)}
    if any(args.is_full_attention(i) not in kinds for i in range(first, args.n_layers)):
        raise ValueError(f"kv_shared_layers={args.kv_shared_layers}: a kv-shared layer's attention type (sliding or full) has "
                         "no earlier layer to share keys and values with")
    if not 0 < args.rope_proportion <= 1:
        raise ValueError(f"rope_proportion={args.rope_proportion} must be in (0, 1]")
    for name in ("global_head_dim", "global_kv_heads"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name}={value} must be positive (or None)")
    if args.n_heads % (args.global_kv_heads or args.n_kv_heads):
        raise ValueError(f"n_heads={args.n_heads} is not a multiple of global_kv_heads={args.global_kv_heads}")
    if args.per_layer_dim < 0:
        raise ValueError(f"per_layer_dim={args.per_layer_dim} must not be negative")
    if args.moe_beside_mlp and not args.n_experts:
        raise ValueError("moe_beside_mlp runs experts beside the dense MLP, but n_experts is 0")


def check_linear_attention(args: ModelArgs) -> None:
    """Gated DeltaNet's and the gated attention's fields."""
    if not 0 < args.partial_rotary_factor <= 1 or args.rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor={args.partial_rotary_factor} must be in (0, 1] and rotate an even number "
                         f"of the head's {args.resolved_head_dim} dims")
    if not args.linear_attention_layers:
        return
    if any(not 0 <= i < args.n_layers for i in args.linear_attention_layers):
        raise ValueError(f"linear_attention_layers={list(args.linear_attention_layers)} must be layers of 0..{args.n_layers - 1}")
    for name in ("linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel"):
        if not getattr(args, name) >= 1:
            raise ValueError(f"{name}={getattr(args, name)} must be positive")
    if args.linear_value_heads % args.linear_key_heads:
        raise ValueError(f"linear_value_heads={args.linear_value_heads} is not a multiple of linear_key_heads={args.linear_key_heads}")
    if args.kv_lora_rank is not None:
        raise ValueError("linear attention layers are not supported with latent attention (kv_lora_rank)")
