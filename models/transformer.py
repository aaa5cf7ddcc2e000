"""A decoder-only transformer in Meta's parameter layout.

Parameter names (the native checkpoint format)::

    tok_embeddings.weight
    layers.{i}.sa_norm.weight
    layers.{i}.attn.{q,k,v,output}_proj.weight
    layers.{i}.mlp_norm.weight
    layers.{i}.mlp.{w1,w2,w3}.weight
    norm.weight
    output.weight            (absent from the state dict's storage when tied)
    layers.{i}.attn.{q,k,v}_proj.bias    (only with ``qkv_bias``, as in Qwen2)
    layers.{i}.attn.{q,k}_norm.weight    (only with ``qk_norm``: Qwen3, Gemma 3)
    layers.{i}.post_{attn,mlp}_norm.weight  (only with ``sandwich_norms``: Gemma 2, Gemma 3)
    layers.{i}.moe.router.weight, layers.{i}.moe.{w1,w2,w3}   (in place of ``mlp``, with ``n_experts``: Mixtral,
                             Qwen3-MoE; the experts stacked [E, ...], see :mod:`waypoint.models.moe`)
    layers.{i}.moe.shared.{w1,w2,w3}.weight, layers.{i}.moe.shared_gate.weight   (a shared expert: Qwen2-MoE)
    layers.{i}.attn.{q_a,q_b,kv_a,kv_b,output}_proj.weight, layers.{i}.attn.{q_a,kv_a}_norm.weight   (with
                             ``kv_lora_rank``: DeepSeek's latent attention, see :mod:`waypoint.models.mla`)
    layers.{i}.attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}.weight, layers.{i}.attn.conv1d.weight,
    layers.{i}.attn.{dt_bias,A_log}, layers.{i}.attn.norm.weight   (the ``linear_attention_layers``: Gated DeltaNet,
                             Qwen3-Next and Qwen3.5/3.6, see :mod:`waypoint.models.gated_deltanet`)
    Gemma 4: layers.{i}.layer_scalar (a buffer); layers.{i}.moe.{router_scale,expert_scale} and
    layers.{i}.{post_dense,moe,post_moe}_norm.weight (experts beside ``mlp``: ``moe_beside_mlp``); per_layer.* and
    layers.{i}.per_layer_input.* (``per_layer_dim``, see :mod:`waypoint.models.per_layer_embeddings`); no k/v
    projections in the ``kv_shared_layers``, no v_proj in full layers with ``attn_k_eq_v``

Rotary embeddings rotate interleaved pairs ``(x0, x1), (x2, x3), ...`` as in
Meta's reference code; Hugging Face rotates the two halves of each head, which
the converters bridge by permuting the rows of the q and k projections (and of
their biases), and the per-head q/k norm weights the same way (as one head).

The other families differ from Llama only through :class:`ModelArgs` fields whose
defaults are Llama's: ``qkv_bias`` (Qwen2); ``qk_norm`` (Qwen3, Gemma 3);
``norm_plus_one``, ``embedding_scale`` and ``activation`` (Gemma 1-3); ``sandwich_norms``,
``attn_scale`` and ``final_softcap`` (Gemma 2, 3); ``attn_softcap`` (Gemma 2);
``rope_type="llama3"`` with its scaling fields (Llama 3.1); ``rope_type="yarn"`` with its own (any
family whose transformers class applies it; gpt-oss, Qwen2.5/3 long context); ``rope_type="linear"`` and
``local_rope_theta`` (Gemma 3); ``sliding_window`` / ``full_attention_layers`` (Mistral,
Phi-3, Qwen2, Gemma 2, 3), ``resid_dropout`` (Phi-3) and the mixture-of-experts fields from
``n_experts`` on (Mixtral, Qwen3-MoE); ``linear_attention_layers`` with Gated DeltaNet's shapes, ``attn_output_gate``
and ``partial_rotary_factor`` (Qwen3-Next, Qwen3.5/3.6); from ``global_head_dim`` to ``double_wide_mlp`` and
``rope_type="proportional"`` (Gemma 4). Each is computed the way
transformers computes it, so logits agree with it in fp32.

:class:`ModelArgs` and the activations live in :mod:`waypoint.models.args`; RMSNorm, the RoPE rotation, the masks
and :class:`Attention` in :mod:`waypoint.models.attention`; all are re-exported here.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.models.args import ACTIVATIONS, ROPE_TYPES, ModelArgs
from waypoint.models.token_logps import linear_token_logps, token_logps_from_logits
from waypoint.models.fused_loss import (ChunkBuffer, linear_cross_entropy_rows, linear_cross_entropy_sum, next_token_loss_rows,
                                        next_token_loss_sum)
from waypoint.models.attention import Attention, RMSNorm, apply_rope, document_mask, sliding_window_mask, softcapped_attention
from waypoint.models.kv_cache import KVCache
from waypoint.models.gated_deltanet import GatedDeltaNet
from waypoint.models.mla import LatentAttention
from waypoint.models.balance_loss import load_balancing_loss, load_balancing_stats
from waypoint.models.moe import MoE
from waypoint.models.per_layer_embeddings import PerLayerEmbeddings, PerLayerInput
from waypoint.models.shared_expert import FeedForward
from waypoint.models.image_tokens import image_mask, place_images, placeholders_as
from waypoint.models.mrope import mrope_positions, mrope_rows
from waypoint.models.vision_towers import image_projector, vision_tower

__all__ = ["ACTIVATIONS", "ROPE_TYPES", "Attention", "FeedForward", "ModelArgs", "RMSNorm", "Transformer", "TransformerBlock",
           "apply_rope", "document_mask", "rope_attention_factor", "rope_cache", "rope_frequencies", "sliding_window_mask",
           "softcapped_attention"]

ROPE_ROWS = 8192  # the positions the rotary tables cover at first (Transformer.reset_rope)


def rope_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """The inverse frequencies [head_dim // 2] in fp32, scaled for ``rope_type="llama3"``, ``"linear"`` or ``"yarn"``
    exactly as transformers' ``_compute_llama3_parameters`` / ``_compute_linear_scaling_rope_parameters`` /
    ``_compute_yarn_parameters`` do (yarn's attention factor: :func:`rope_attention_factor`)."""
    if args.rope_type == "proportional":
        return _proportional_frequencies(args, device)
    head_dim = args.rotary_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    if args.rope_type == "default":
        return inv_freq
    if args.rope_type == "linear":
        return inv_freq / args.rope_factor
    if args.rope_type == "yarn":
        return _yarn_frequencies(args, inv_freq)
    factor, low, high = args.rope_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_context_len = args.rope_original_max_seq_len
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the ones between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _proportional_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """Gemma 4's full-attention layers (transformers' ``_compute_proportional_rope_parameters``): of each head's
    ``head_dim // 2`` pairs the first ``rope_proportion`` turn at ``base ** (-2i / head_dim)``, the rest not at all."""
    head_dim = args.global_head_dim or args.resolved_head_dim  # the full-attention layers'
    angles = int(args.rope_proportion * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, device=device, dtype=torch.int64).float() / head_dim
    rotated = 1.0 / (args.rope_theta ** exponents)
    still = torch.zeros(head_dim // 2 - angles, device=device, dtype=torch.float32)
    return torch.cat([rotated, still]) / args.rope_factor


def _yarn_frequencies(args: ModelArgs, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: the unscaled frequencies (``inv_freq``) kept for dimensions that turn more than ``rope_beta_fast`` times
    over the original context, divided by ``rope_factor`` for those turning fewer than ``rope_beta_slow`` times, a
    linear ramp between; each step as transformers' ``_compute_yarn_parameters`` takes it, so the bits agree."""
    dim, base, original = args.rotary_dim, args.rope_theta, args.rope_original_max_seq_len

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(args.rope_beta_fast), correction_dim(args.rope_beta_slow)
    if args.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).to(inv_freq.device)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=inv_freq.device, dtype=torch.int64).float() / dim)
    interpolation = 1.0 / (args.rope_factor * pos_freqs)  # inv_freq is 1.0 / pos_freqs, the extrapolated frequencies
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(args: ModelArgs) -> float:
    """What the cos/sin table is multiplied by: ``rope_attention_factor`` for yarn, else derived from ``rope_factor``
    (with ``rope_mscale`` / ``rope_mscale_all_dim`` where both are set) as transformers does; 1.0 for other types."""
    if args.rope_type != "yarn":
        return 1.0
    if args.rope_attention_factor is not None:
        return args.rope_attention_factor

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if args.rope_mscale and args.rope_mscale_all_dim:
        return float(get_mscale(args.rope_factor, args.rope_mscale) / get_mscale(args.rope_factor, args.rope_mscale_all_dim))
    return get_mscale(args.rope_factor)


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None,
               inv_freq: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """cos/sin table of shape [max_seq_len, head_dim // 2, 2], in fp32 (``inv_freq``: precomputed frequencies;
    ``scale``: cos and sin multiplied by it in fp32, yarn's attention factor, which scales q and k alike)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    if scale != 1.0:
        return torch.stack([angles.cos() * scale, angles.sin() * scale], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


class TransformerBlock(nn.Module):
    """Pre-norm block; ``mlp``: a module [.., dim] -> [.., dim] in place of the gated MLP."""

    def __init__(self, args: ModelArgs, layer_id: int = 0, mlp: nn.Module | None = None) -> None:
        super().__init__()
        norm = partial(RMSNorm, args.dim, args.norm_eps, args.norm_plus_one, args.norm_fp32_weight)
        self.sa_norm = norm()
        # the token mixer: attention, DeepSeek's latent attention, or Gated DeltaNet (Qwen3-Next / 3.5's linear layers)
        self.linear = layer_id in args.linear_attention_layers
        self.attn = (GatedDeltaNet(args) if self.linear else Attention(args, layer_id) if args.kv_lora_rank is None
                     else LatentAttention(args))
        self.mlp_norm = norm()
        # the dense gated MLP, or in a mixture-of-experts layer ``moe`` in its place (``mlp`` None), or beside it (Gemma 4)
        sparse = args.n_experts > 0 and layer_id not in args.dense_layers and mlp is None
        wide = 2 if args.double_wide_mlp and args.kv_source(layer_id) is not None else 1  # Gemma 4's kv-shared layers
        self.mlp = (None if sparse and not args.moe_beside_mlp else mlp if mlp is not None
                    else FeedForward(args.dim, args.hidden_dim * wide, args.activation))
        self.moe = MoE(args.dim, args.expert_hidden_dim or args.hidden_dim, args.n_experts, args.experts_per_token,
                       args.normalize_expert_weights, args.activation, fp32_routing_weights=args.expert_weights_fp32,
                       router_bias=args.router_bias, expert_bias=args.expert_bias, routing=args.routing,
                       groups=(args.expert_groups, args.topk_groups), routed_scaling=args.routed_scaling,
                       swiglu_limit=args.swiglu_limit, swiglu_alpha=args.swiglu_alpha,
                       shared_hidden_dim=args.shared_expert_hidden_dim, shared_gate=args.shared_expert_gate,
                       norm_eps=args.norm_eps) if sparse else None
        self.router_logits: torch.Tensor | None = None  # the MoE router's logits of the last forward
        # Gemma 2/3 also normalise the attention and MLP outputs before each residual add; None otherwise
        self.post_attn_norm = norm() if args.sandwich_norms else None
        self.post_mlp_norm = norm() if args.sandwich_norms else None
        # Gemma 4's experts beside the MLP: the MLP's output normed, the experts' input and output normed
        beside = sparse and args.moe_beside_mlp
        self.post_dense_norm, self.moe_norm, self.post_moe_norm = (norm(), norm(), norm()) if beside else (None, None, None)
        # Gemma 4: the per-layer embeddings' update (models.per_layer_embeddings), the output's stored scale
        self.per_layer_input = PerLayerInput(args) if args.per_layer_dim else None
        if args.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        self.resid_dropout = args.resid_dropout
        # the window this layer's attention slides (None: full causal attention)
        self.sliding_window = args.sliding_window if layer_id not in args.full_attention_layers else None

    def _residual(self, x: torch.Tensor, out: torch.Tensor, post_norm: nn.Module | None) -> torch.Tensor:
        if post_norm is not None:
            out = post_norm(out)
        return x + (F.dropout(out, self.resid_dropout, training=True) if self.resid_dropout and self.training else out)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None, cache=None,
                layer: int = 0, per_layer_input: torch.Tensor | None = None, shared_kv: dict | None = None) -> torch.Tensor:
        attn_kwargs = {} if shared_kv is None else {"shared_kv": shared_kv}
        h = self._residual(x, self.attn(self.sa_norm(x), rope, mask, cache, layer, **attn_kwargs), self.post_attn_norm)
        if self.moe is None:
            out = self.mlp(self.mlp_norm(h))
        elif self.mlp is None:
            out, self.router_logits = self.moe(self.mlp_norm(h))
        else:  # Gemma 4: the router reads the residual itself
            sparse, self.router_logits = self.moe(self.moe_norm(h), route_input=h)
            out = self.post_dense_norm(self.mlp(self.mlp_norm(h))) + self.post_moe_norm(sparse)
        h = self._residual(h, out, self.post_mlp_norm)
        if self.per_layer_input is not None:
            h = h + self.per_layer_input(h, per_layer_input)
        if hasattr(self, "layer_scalar"):
            h = h * self.layer_scalar
        return h


class Transformer(nn.Module):
    """``model(tokens [batch, seq]) -> logits [batch, seq, vocab]``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # An explicit (empty) weight skips nn.Embedding's init, which on the meta device costs a
        # one-off ~0.8 s import of torch._dynamo; off the meta device it is initialised as usual.
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        if not self.tok_embeddings.weight.is_meta:
            nn.init.normal_(self.tok_embeddings.weight)
        # Gemma 4's per-layer embeddings (models.per_layer_embeddings); None without
        self.per_layer = PerLayerEmbeddings(args) if args.per_layer_dim else None
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        # a vision-language model's image side (``args.vision``): the tower and the projector into the text's width
        self.vision = vision_tower(args.vision)
        self.projector = image_projector(args.vision, args.dim)
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_plus_one, args.norm_fp32_weight)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.activation_checkpointing = False
        self.loss_buffer = ChunkBuffer()  # the fused loss's chunk logits on the CPU, reused by every step (not state)
        self.router_logits: list[torch.Tensor] = []  # each MoE layer's router logits in the last forward
        self.register_buffer("rope", torch.empty(0), persistent=False)
        if args.local_rope_theta is not None:  # the sliding layers' table (Gemma 3)
            self.register_buffer("local_rope", torch.empty(0), persistent=False)
        self.tie_weights()
        self.reset_rope()

    def tie_weights(self) -> None:
        """Share the output projection with the embedding when the model is tied."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def reset_rope(self, rows: int | None = None) -> None:
        """(Re)compute the rotary tables on the embedding's device; call after loading onto a meta-built model.
        ``rows``: the positions they cover (default ``ROPE_ROWS``; never past max_seq_len); ``forward`` extends them when
        a longer sequence comes, with the same bits for the positions they had (a 262144-position Gemma 4 table with
        512-wide heads would hold 0.5 GB on every GPU for the few thousand positions a fine-tune uses)."""
        device = self.tok_embeddings.weight.device
        a = self.args
        if device.type == "meta":  # nothing to compute yet (and meta kernels for it cost a slow import)
            self.rope = torch.empty(0, device=device)
            if a.local_rope_theta is not None:
                self.local_rope = torch.empty(0, device=device)
            return
        rows = min(a.max_seq_len, rows or ROPE_ROWS)
        self.rope = rope_cache(a.rotary_dim, rows, a.rope_theta, device=device,
                               inv_freq=rope_frequencies(a, device=device), scale=rope_attention_factor(a))
        if a.local_rope_theta is not None:  # unscaled, whatever rope_type the full-attention layers use
            self.local_rope = rope_cache(a.rotary_dim, rows, a.local_rope_theta, device=device)

    def init_weights(self, std: float = 0.02) -> None:
        """Random initialisation for training from scratch (tests, tiny models)."""
        for name, p in self.named_parameters():
            if name.endswith(("router_scale", "expert_scale")):
                nn.init.ones_(p)
            elif name.startswith("vision.") and name.endswith(".weight") and p.dim() == 1:  # the tower's LayerNorms
                nn.init.ones_(p)
            elif name.endswith("norm.weight"):
                (nn.init.zeros_ if self.args.norm_plus_one else nn.init.ones_)(p)
            elif name.endswith((".bias", "moe.b1", "moe.b2", "moe.b3")):
                nn.init.zeros_(p)
            else:
                down = name.endswith(("output_proj.weight", "w2.weight", "moe.w2"))
                nn.init.normal_(p, std=std if not down else std / math.sqrt(2 * self.args.n_layers))
        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.init_own_weights()

    def aux_loss(self) -> torch.Tensor | None:
        """The last forward's load-balancing loss over every MoE layer (transformers' ``aux_loss``, not yet weighted by
        ``router_aux_loss_coef``); None for a dense model."""
        if not self.args.n_experts or not self.router_logits:
            return None
        return load_balancing_loss(self.router_logits, self.args.n_experts, self.args.experts_per_token)

    def aux_stats(self, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The last forward's ``load_balancing_stats`` over the tokens ``mask`` [batch, seq] keeps (sums that add up
        across ranks); None for a dense model."""
        if not self.args.n_experts or not self.router_logits:
            return None
        return load_balancing_stats(self.router_logits, self.args.n_experts, self.args.experts_per_token, mask)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                labels: torch.Tensor | None = None, loss_chunk: int | None = None,
                per_sequence: bool = False, per_token: bool = False, temperature: float = 1.0,
                pixel_values: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, mm_token_type_ids: torch.Tensor | None = None,
                image_position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` [batch, seq] -> logits [batch, seq, vocab]. Packed sequences (``training.packing``) also give
        each token's ``positions`` (restarting per sample) and ``document_ids`` (attention stays within one).
        With a ``cache`` (generation), ``tokens`` follow the cached ones and the cache takes their keys and values.
        With ``labels`` [batch, seq]: the next-token loss sum instead (``fused_loss``: the output projection fused
        with the loss, ``loss_chunk`` tokens at a time, default by the vocabulary's size; 0: the full logits).
        With ``labels`` and ``per_sequence``: each sequence's loss sum, a [batch] vector, by the same two paths.
        With ``labels`` and ``per_token``: (each next label's log-prob, its distribution's entropy), [batch, seq - 1]
        each, 0 where the label is ignored, of the logits divided by ``temperature`` (``models.token_logps``).
        A vision-language model (``args.vision``) takes its processor's outputs by transformers' names: ``pixel_values``
        (Gemma 3's [images, channels, size, size]; Qwen3.5's patches with ``image_grid_thw``; Gemma 4's with
        ``image_position_ids``), whose embeddings replace the image tokens' (``models.image_tokens``), and the token
        types, 1 on image tokens, [batch, seq]: ``token_type_ids`` (Gemma 3: an image's tokens attend each other both
        ways) or ``mm_token_type_ids`` (Gemma 4: both ways in the sliding layers where its config says so; Qwen3.5:
        mRoPE positions for them, ``models.mrope``)."""
        if (per_sequence or per_token) and labels is None:
            raise ValueError("per_sequence and per_token need labels")
        start = cache.length if cache is not None else 0
        if start + tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(f"sequence length {start + tokens.shape[1]} exceeds max_seq_len {self.args.max_seq_len}")
        if start + tokens.shape[1] > self.rope.shape[0]:  # the tables grow (doubling) as longer sequences come
            self.reset_rope(max(start + tokens.shape[1], 2 * self.rope.shape[0]))
        looked_up = self._text_tokens(tokens)
        h = self.tok_embeddings(looked_up)
        if self.args.embedding_scale != 1.0:
            # as transformers: the scale rounded to fp32, then to the embedding's dtype
            h = h * torch.tensor(self.args.embedding_scale, dtype=torch.float32, device=h.device).to(h.dtype)
        if pixel_values is not None and not pixel_values.shape[0] and not bool((tokens == self._image_token()).any()):
            pixel_values = None  # a batch without images (Gemma's processors still give an empty pixel_values)
        if pixel_values is not None:
            if self.vision is None:
                raise ValueError("pixel_values given to a text model (its checkpoint has no vision tower)")
            where = {"image_grid_thw": image_grid_thw, "image_position_ids": image_position_ids}
            h = place_images(h, tokens, self.image_features(pixel_values, **where), self.args.vision.image_token_id)
        types = token_type_ids if token_type_ids is not None else mm_token_type_ids
        has_images = types is not None and self.args.vision is not None and bool((types == 1).any())
        offset = cache.position_offset if cache is not None else 0  # mRoPE: positions behind tokens after images
        seq = tokens.shape[1]
        window = self.args.sliding_window
        local_rope = self.local_rope if self.args.local_rope_theta is not None else self.rope
        if cache is not None:  # positions start .. start + seq, over the cached keys as well
            full_mask, window_mask = cache.mask(seq, None, h.device), cache.mask(seq, window, h.device)
            global_rope, local_rope = cache.rope_rows(self.rope, seq, offset), cache.rope_rows(local_rope, seq, offset)
        elif document_ids is None:
            full_mask, window_mask = None, sliding_window_mask(seq, window, h.device) if window is not None and seq > window else None
            global_rope = self.rope
        else:  # packed: each token's own rope rows, attention within its document
            full_mask = document_mask(document_ids)
            window_mask = document_mask(document_ids, window) if window is not None else None
            global_rope, local_rope = self.rope[positions], local_rope[positions]
        if has_images and self.args.vision.image_attention == "bidirectional":  # an image's tokens see each other
            full_mask = image_mask(types, None, document_ids, start)
            window_mask = image_mask(types, window, document_ids, start) if window is not None else None
        elif has_images and self.args.vision.image_attention == "sliding_bidirectional":  # Gemma 4: in the window only
            window_mask = image_mask(types, window, document_ids, start)
        if has_images and self.args.mrope_section is not None and image_grid_thw is not None:
            global_rope = self._mrope(types, image_grid_thw, start + offset, cache)
        per_layer = self.per_layer(looked_up, h) if self.per_layer is not None else None
        extra: dict = {"shared_kv": {}} if self.args.kv_shared_layers else {}  # Gemma 4: keys and values layers share
        for index, layer in enumerate(self.layers):
            sliding = layer.sliding_window is not None
            mask, rope = (window_mask, local_rope) if sliding else (full_mask, global_rope)
            if layer.linear:  # Gated DeltaNet: no positions; a packed batch's documents, not a mask
                mask, rope = document_ids, None
            if per_layer is not None:
                extra["per_layer_input"] = per_layer[:, :, index]
            if self.activation_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(layer, h, rope, mask, None, index, **extra, use_reentrant=False)
            else:
                h = layer(h, rope, mask, cache, index, **extra)
        if cache is not None:
            cache.advance(seq)
        h = self.norm(h)
        if self.args.n_experts:
            self.router_logits = [layer.router_logits for layer in self.layers if layer.moe is not None]
        if labels is not None and loss_chunk != 0 and _plain_projection(self.output):
            # the chunks' buffer is kept from step to step on the CPU, whose allocator hands a freed chunk back to the
            # system; CUDA's caching allocator keeps the freed block itself, for the next chunk and other tensors alike
            buffer = self.loss_buffer if h.device.type == "cpu" else None
            if per_token:
                return linear_token_logps(h, self.output.weight, labels, loss_chunk, self.args.final_softcap,
                                          temperature, buffer)
            fused = linear_cross_entropy_rows if per_sequence else linear_cross_entropy_sum
            return fused(h, self.output.weight, labels, loss_chunk, self.args.final_softcap, buffer)
        logits = self.output(h)
        if per_token:
            return token_logps_from_logits(self._capped(logits), labels, temperature)
        if labels is not None:
            return (next_token_loss_rows if per_sequence else next_token_loss_sum)(self._capped(logits), labels)
        return self._capped(logits)

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
                       image_position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The processor's pixel values -> the embeddings the image tokens take, in order: the tower (Qwen3.5's with
        each image's grid, Gemma 4's with each patch's position), then the projector where the tower has none of its
        own (Gemma 3's)."""
        given = {"image_grid_thw": image_grid_thw, "image_position_ids": image_position_ids}
        missing = [name for name in self.vision.INPUTS if given[name] is None]
        if missing:
            raise ValueError(f"pixel_values without {missing[0]}: this model's vision tower needs it (its processor gives both)")
        features = self.vision(pixel_values, *(given[name] for name in self.vision.INPUTS))
        return self.projector(features) if self.projector is not None else features

    def _text_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The ids the embeddings look up: Gemma 4's placeholders (its vision args' ``placeholder_ids``) as the pad
        token, as transformers' Gemma4Model, whether or not their media came; other models' tokens as they are."""
        ids = getattr(self.args.vision, "placeholder_ids", ())
        return placeholders_as(tokens, ids, self.args.vision.pad_token_id) if ids else tokens

    def _image_token(self) -> int:
        return self.args.vision.image_token_id if self.args.vision is not None else -1

    def _mrope(self, types: torch.Tensor, image_grid_thw: torch.Tensor, first: int, cache: KVCache | None) -> torch.Tensor:
        """Each token's rotary rows under mRoPE (``models.mrope``), its positions from ``first``; a generation's cache
        keeps the delta its later tokens' positions take."""
        positions, deltas = mrope_positions(types, image_grid_thw, self.args.vision.merge_size)
        if cache is not None:
            if len(set(deltas.tolist())) > 1:
                raise ValueError("a cached generation over rows with different image layouts: generate one at a time")
            cache.position_offset += int(deltas[0])
        return mrope_rows(self.rope, positions + first, self.args.mrope_section)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.args.final_softcap is not None:
            cap = self.args.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


def _plain_projection(output: nn.Module) -> bool:
    """Whether the output projection is a plain bias-free ``nn.Linear`` over an ordinary weight (not a LoRA
    layer, not a quantized or still-sharded tensor), so that the fused loss may use its weight directly."""
    return type(output) is nn.Linear and output.bias is None and type(output.weight) in (nn.Parameter, torch.Tensor)
