"""A mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE) in the native parameter layout.

Parameter names (the native checkpoint format, under each layer's ``mlp.``)::

    router.weight   [n_experts, dim]                 transformers' ``mlp.gate.weight``
    w1              [n_experts, hidden_dim, dim]     gate: expert e's ``gate_proj.weight`` is ``w1[e]``
    w3              [n_experts, hidden_dim, dim]     up:   expert e's ``up_proj.weight`` is ``w3[e]``
    w2              [n_experts, dim, hidden_dim]     down: expert e's ``down_proj.weight`` is ``w2[e]``

    router.bias, b1, b3 [n_experts, hidden_dim], b2 [n_experts, dim]   (gpt-oss only: ``router_bias``, ``expert_bias``)
    shared.{w1,w2,w3}.weight, shared_gate.weight     (a shared expert: ``shared_hidden_dim``, ``shared_gate``;
                                                      Qwen2-MoE, see ``models.shared_expert``)
    router.e_score_correction_bias [n_experts]       (a buffer, DeepSeek-V3's ``routing="sigmoid_grouped"``: the
                                                      DeepSeek routings are ``models.grouped_routing``'s)

Rows are output features as in ``nn.Linear``; transformers' packed ``experts.gate_up_proj`` [E, 2I, H] is
``cat((w1, w3), dim=1)`` and its ``experts.down_proj`` is ``w2``.

gpt-oss differs in three places, each a constructor option: the router has a bias and takes the top-k logits
before a softmax over them (``routing="topk_softmax"``, in the logits' dtype, as ``GptOssTopKRouter``); each
expert projection has a bias; the gate is its clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``: see ``gated``).

Each token goes to ``top_k`` of the experts, each expert being the dense block's gated MLP
``w2[e](act(w1[e] x) * w3[e] x)``, and the outputs are summed with the routing weights. Routing is the
families' (transformers' ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``): router logits in the input's dtype,
a softmax in fp32 (fp64 for fp64 inputs) over all experts, the top-k of the probabilities, renormalised to sum 1
when ``normalize_topk`` (always in Mixtral; Qwen3-MoE's ``norm_topk_prob``). Qwen3-MoE casts the top-k weights
back to the input's dtype before weighting the experts' outputs; Mixtral keeps them in fp32 and rounds each
weighted output to the input's dtype (``fp32_routing_weights=True``). That only matters below fp32, where with
the family's setting and top-2 the output is bitwise transformers'. The k weighted outputs of a token are summed
in fp32 (transformers adds them into a tensor of the input's dtype, one rounding per expert), so above top-2 a
bf16 output may differ from transformers' in the last bit, no further from the fp32 result.

Three interchangeable implementations of the experts' part, chosen by the module attribute ``impl``:

``"grouped"``  token-expert assignments sorted by expert, then one ``grouped_mm`` per projection
               (``torch.nn.functional.grouped_mm`` or ``torch._grouped_mm``) over the per-expert offsets;
``"padded"``   the same sorted assignments scattered into a zero-padded [E, capacity, dim] buffer
               (capacity: the busiest expert's count) and one ``bmm`` per projection;
``"loop"``     a Python loop over the experts, as transformers' eager path: the reference (on a CPU about as fast,
               grouped_mm's CPU kernel being a loop of matmuls too; elsewhere a launch and a host sync per expert);
``"auto"``     (default) ``"grouped"`` where the installed torch's ``grouped_mm`` runs forward and backward
               for the device and dtype (probed once per device and dtype, see :func:`grouped_mm_supported`)
               and the weights suit its kernels (16-byte aligned, rows a multiple of 16 bytes), otherwise
               ``"padded"``.

All give the same outputs and gradients up to the dtype's rounding. With ``quantize_base: mxfp4`` (or ``fp8``) the
experts' w1, w3, w2 are ``MXFP4Weight`` (``FP8Weight``): every product dequantizes them inside
``packed_weight.PackedMatmul``, in its forward and again in its backward, so autograd keeps no dense copy of them. ``forward`` returns the output and the
router logits [tokens, E], which ``balance_loss.load_balancing_loss`` turns into transformers' auxiliary loss.
Mixtral's ``router_jitter_noise`` (multiplicative noise on the input while training; 0 in its checkpoints) is not
implemented.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from waypoint.models.args import ACTIVATIONS, GROUPED_ROUTINGS
from waypoint.models.attention import RMSNorm
from waypoint.models.grouped_routing import grouped_route
from waypoint.models.grouped_mm import grouped_mm_fn, grouped_mm_layout_ok, grouped_mm_supported
from waypoint.models.lora_experts import LoRAExperts, expert_update
from waypoint.models.packed_weight import experts_mm, linear
from waypoint.models.shared_expert import FeedForward, init_shared, shared_output

IMPLS = ("auto", "grouped", "padded", "loop")

class MoE(nn.Module):
    """``moe(x [..., dim]) -> (out [..., dim], router_logits [tokens, n_experts])``; see the module docstring."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, normalize_topk: bool = True,
                 activation: str = "silu", *, fp32_routing_weights: bool = False, impl: str = "auto",
                 router_bias: bool = False, expert_bias: bool = False, routing: str = "softmax_topk",
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702,
                 shared_hidden_dim: int | None = None, shared_gate: bool = False,
                 groups: tuple[int, int] = (1, 1), routed_scaling: float = 1.0, norm_eps: float = 1e-6) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.dim, self.hidden_dim, self.n_experts, self.top_k = dim, hidden_dim, n_experts, top_k
        self.normalize_topk = normalize_topk
        self.fp32_routing_weights = fp32_routing_weights
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.impl = impl
        self.routing, self.swiglu_limit, self.swiglu_alpha = routing, swiglu_limit, swiglu_alpha
        self.router = nn.Linear(dim, n_experts, bias=router_bias)
        # DeepSeek (``grouped_routing``): (n_groups, topk_groups), the weights' scale, and V3's per-expert score bias for
        # choosing (a buffer, as transformers' ``e_score_correction_bias``: in the checkpoint, not trained)
        self.groups, self.routed_scaling = tuple(groups), routed_scaling
        if routing == "sigmoid_grouped":
            self.router.register_buffer("e_score_correction_bias", torch.zeros(n_experts, device=self.router.weight.device))
            # loaded in the checkpoint's dtype whatever the model's (transformers keeps it in fp32): a bf16 run
            # neither rounds the selection nor writes the untrained bias back rounded
            self.router.keep_dtype = ("e_score_correction_bias",)
        if routing == "normed_softmax_topk":  # Gemma 4: the router's input normed and scaled, each expert's weight too
            self.router_norm = RMSNorm(dim, norm_eps, fp32_weight=True, weight=False)
            self.router_scale = nn.Parameter(torch.ones(dim, device=self.router.weight.device))
            self.expert_scale = nn.Parameter(torch.ones(n_experts, device=self.router.weight.device))
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        # gpt-oss: each expert's biases (None without expert_bias)
        self.b1 = nn.Parameter(torch.zeros(n_experts, hidden_dim, device=self.w1.device)) if expert_bias else None
        self.b3 = nn.Parameter(torch.zeros(n_experts, hidden_dim, device=self.w1.device)) if expert_bias else None
        self.b2 = nn.Parameter(torch.zeros(n_experts, dim, device=self.w1.device)) if expert_bias else None
        # each forward's chosen experts, recorded (``replaying`` False) or taken in turn instead of the top-k
        # (``replaying`` True): ``same_routing``; None: neither
        self.routes: list[torch.Tensor] | None = None
        self.replaying = False
        # LoRA on the stacked experts (``lora_experts``: PEFT's parameter targets); None until added
        self.experts_gate_up: LoRAExperts | None = None
        self.experts_down: LoRAExperts | None = None
        # a dense expert on every token, optionally gated (``shared_expert``: Qwen2-MoE, DeepSeek); None without
        self.shared = FeedForward(dim, shared_hidden_dim, activation) if shared_hidden_dim else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_hidden_dim and shared_gate else None
        if not self.w1.is_meta:
            self.init_weights()

    def init_weights(self, std: float = 0.02, down_std: float | None = None) -> None:
        """Normal(0, ``std``) for the router and the experts' w1 / w3, Normal(0, ``down_std``) (default ``std``)
        for w2: transformers' initialisation of both families (``initializer_range``) for training from scratch."""
        with torch.no_grad():
            for p in (self.router.weight, self.w1, self.w3):
                nn.init.normal_(p, std=std)
            nn.init.normal_(self.w2, std=std if down_std is None else down_std)
            init_shared(self.shared, self.shared_gate, std, std if down_std is None else down_std)
            for p in (self.router.bias, self.b1, self.b2, self.b3):
                if p is not None:
                    nn.init.zeros_(p)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, n_experts={self.n_experts}, top_k={self.top_k}, "
                f"normalize_topk={self.normalize_topk}, fp32_routing_weights={self.fp32_routing_weights}, "
                f"activation={self.activation}, impl={self.impl}"
                + (f", routing={self.routing}" if self.routing != "softmax_topk" else "")
                + (f", swiglu_limit={self.swiglu_limit}" if self.swiglu_limit is not None else "")
                + (f", shared_gate={self.shared_gate is not None}" if self.shared is not None else ""))

    # -- routing -----------------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [tokens, dim] -> (router logits [tokens, E] in x's dtype, top-k weights [tokens, k], expert
        indices [tokens, k]), in transformers' order of operations (DeepSeek's: fp32 logits, ``grouped_routing``)."""
        replay = self.routes.pop(0).to(x.device) if self.routes is not None and self.replaying else None
        if self.routing == "normed_softmax_topk":  # Gemma4TextRouter's scaled input
            x = self.router_norm(x) * self.router_scale * self.dim ** -0.5
        logits = self.router(x) if self.routing not in GROUPED_ROUTINGS else None
        if self.routing in GROUPED_ROUTINGS:  # DeepSeek: fp32 logits and weights
            logits, weights, experts = grouped_route(x, self.router.weight, self.top_k, self.routing, *self.groups,
                                                     self.normalize_topk, self.routed_scaling,
                                                     getattr(self.router, "e_score_correction_bias", None), replay)
            weights = weights if self.fp32_routing_weights else weights.to(x.dtype)
        elif self.routing == "topk_softmax":  # gpt-oss: the top-k logits, then a softmax over them in their dtype
            top, experts = torch.topk(logits, self.top_k, dim=-1) if replay is None else (logits.gather(-1, replay), replay)
            weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
            weights, experts = torch.topk(probs, self.top_k, dim=-1) if replay is None else (probs.gather(-1, replay), replay)
            if self.routing == "normed_softmax_topk":  # renormalised, then each expert's scale, all in fp32
                weights = weights / weights.sum(dim=-1, keepdim=True) * self.expert_scale[experts]
            else:
                weights = self._normalized(weights, logits.dtype)
        if self.routes is not None and not self.replaying:
            self.routes.append(experts.detach())
        return logits, weights, experts

    def _normalized(self, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The top-k probabilities renormalised (``normalize_topk``) and, unless ``fp32_routing_weights``, in ``dtype``."""
        if self.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_routing_weights:
            weights = weights.to(dtype)
        return weights

    def resolved_impl(self, x: torch.Tensor) -> str:
        """The implementation ``forward`` uses for ``x`` (``impl``, with ``"auto"`` resolved)."""
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is not one of {', '.join(IMPLS)}")
        if self.impl != "auto":
            return self.impl
        if grouped_mm_supported(x.device, self.w1.dtype) and grouped_mm_layout_ok(self.w1, self.w2, self.w3):
            return "grouped"
        return "padded"

    def forward(self, x: torch.Tensor, route_input: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``route_input``: what the router sees, where it is not ``x`` (Gemma 4 routes the un-normed residual)."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        logits, weights, experts = self.route(x if route_input is None else route_input.reshape(-1, self.dim))
        impl = self.resolved_impl(x)
        if x.shape[0] == 0:
            out = x.new_zeros(x.shape)
        elif impl == "loop":
            out = self._experts_loop(x, weights, experts)
        else:
            out = self._experts_sorted(x, weights, experts, grouped=impl == "grouped")
        if self.shared is not None:  # added after the routed experts' sum, in x's dtype (Qwen2MoeSparseMoeBlock)
            out = out + shared_output(self.shared, self.shared_gate, x)
        return out.reshape(shape), logits

    # -- the experts -------------------------------------------------------------------------------------------
    def gated(self, h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
        """The gated hidden state from the gate (w1) and up (w3) projections: ``act(h1) * h3``, or with
        ``swiglu_limit`` gpt-oss's clamped SwiGLU in transformers' order of operations."""
        if self.swiglu_limit is None:
            return self.act(h1) * h3
        gate, up = h1.clamp(max=self.swiglu_limit), h3.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def _experts_loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """One expert at a time, as transformers' eager implementation: the reference. The stacked weights are
        unbound once (indexing ``w1[e]`` per expert would make autograd build a full-size zero gradient for each)."""
        k = self.top_k
        flat_experts, flat_weights = experts.reshape(-1), weights.reshape(-1)
        w1, w2, w3 = self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0)
        b1, b2, b3 = (b.unbind(0) if b is not None else [None] * self.n_experts for b in (self.b1, self.b2, self.b3))
        out = x.new_zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32))
        for e in range(self.n_experts):
            idx = (flat_experts == e).nonzero().squeeze(1)  # this expert's assignments (token * k + slot)
            if idx.numel() == 0:
                continue
            tokens = idx // k
            xe = x[tokens]
            h1, h3 = linear(xe, w1[e], b1[e]), linear(xe, w3[e], b3[e])  # F.linear, or PackedMatmul per expert
            if self.experts_gate_up is not None and not self.experts_gate_up.disabled:
                d = self.experts_gate_up.expert(e, xe)
                h1, h3 = h1 + d[:, 0::2], h3 + d[:, 1::2]
            g = self.gated(h1, h3)
            y = expert_update(self.experts_down, linear(g, w2[e], b2[e]), lambda m: m.expert(e, g))
            out.index_add_(0, tokens, (y * flat_weights[idx, None]).to(x.dtype).to(out.dtype))
        return out.to(x.dtype)

    def _experts_sorted(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, grouped: bool) -> torch.Tensor:
        """All assignments sorted by expert, then either grouped_mm over the per-expert offsets or a bmm over a
        zero-padded [E, capacity, dim] buffer (``experts_mm``: a packed weight's dense copy lives inside the product only)."""
        n_tokens, k, n_experts = x.shape[0], self.top_k, self.n_experts
        flat_experts = experts.reshape(-1)
        sorted_experts, order = torch.sort(flat_experts, stable=True)
        # each token's row once per slot ((token, slot) order), then in expert order: an expand and a permutation,
        # whose backward sums in a fixed order (x[tokens] would accumulate each token's k rows in whatever order
        # the CPU's threads reach them, and a rerun would not be bit-identical)
        x_slots = x.unsqueeze(1).expand(n_tokens, k, self.dim).reshape(n_tokens * k, self.dim)
        # ends[e]: the number of assignments to experts <= e, which grouped_mm takes as offsets (no host sync)
        ends = torch.searchsorted(sorted_experts, torch.arange(n_experts, device=x.device), right=True, out_int32=True)
        n_assignments = order.numel()
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n_assignments, device=x.device))
        if grouped:
            mm = grouped_mm_fn()
            xs = x_slots[order].to(self.w1.dtype)  # [S, dim] (grouped_mm is not autocast-aware)
            h1, h3 = experts_mm(xs, self.w1, ends, mm), experts_mm(xs, self.w3, ends, mm)
            if self.b1 is not None:  # each sorted assignment's expert's bias
                h1, h3 = h1 + expert_rows(self.b1, sorted_experts, ends), h3 + expert_rows(self.b3, sorted_experts, ends)
            if self.experts_gate_up is not None and not self.experts_gate_up.disabled:
                d = self.experts_gate_up.grouped(xs, ends)  # gate and up interleaved
                h1, h3 = h1 + d[:, 0::2], h3 + d[:, 1::2]
            g = self.gated(h1, h3).to(self.w2.dtype)
            ys = experts_mm(g, self.w2, ends, mm)
            if self.b2 is not None:
                ys = ys + expert_rows(self.b2, sorted_experts, ends)
            ys = expert_update(self.experts_down, ys, lambda m: m.grouped(g, ends))[inverse]  # [S, dim], (token, slot) order
        else:
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            capacity = int(counts.max())  # one host sync
            # each sorted assignment's row in the [E * capacity] buffer; the rows left over read a zero row
            slots = sorted_experts * capacity + torch.arange(n_assignments, device=x.device) - (ends - counts)[sorted_experts]
            source = torch.full((n_experts * capacity,), n_assignments, device=x.device).index_put_((slots,), order)
            buf = torch.cat([x_slots, x.new_zeros(1, self.dim)])[source].view(n_experts, capacity, self.dim)
            h1, h3 = experts_mm(buf, self.w1), experts_mm(buf, self.w3)
            if self.b1 is not None:  # rows past an expert's count read a zero row and are never gathered
                h1, h3 = h1 + self.b1[:, None], h3 + self.b3[:, None]
            if self.experts_gate_up is not None and not self.experts_gate_up.disabled:
                d = self.experts_gate_up.batched(buf)
                h1, h3 = h1 + d[..., 0::2], h3 + d[..., 1::2]
            g = self.gated(h1, h3)
            ys = experts_mm(g, self.w2)
            if self.b2 is not None:
                ys = ys + self.b2[:, None]
            ys = expert_update(self.experts_down, ys, lambda m: m.batched(g))
            ys = ys.view(n_experts * capacity, self.dim)[slots[inverse]]
        # weighted, rounded to x's dtype (as transformers), summed over each token's k slots in fp32 at least
        # (deterministic, unlike an index_add)
        ys = (ys * weights.reshape(-1, 1)).to(x.dtype).view(n_tokens, k, self.dim)
        return ys.sum(dim=1, dtype=torch.promote_types(x.dtype, torch.float32)).to(x.dtype)


class _ExpertRows(torch.autograd.Function):
    """``table[sorted_experts]`` (each sorted assignment's row of a per-expert table, e.g. a bias), whose backward sums
    each expert's rows as one contiguous slice (``ends``), in a fixed order, rather than accumulating them by index."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, sorted_experts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ends)
        return table[sorted_experts]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ends,) = ctx.saved_tensors
        bounds = [0] + ends.tolist()
        return torch.stack([grad[a:b].sum(0) for a, b in zip(bounds, bounds[1:])]), None, None


def expert_rows(table: torch.Tensor, sorted_experts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return _ExpertRows.apply(table, sorted_experts, ends)


@contextmanager
def same_routing(model: nn.Module, routes: dict[str, list[torch.Tensor]] | None = None) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Within: every MoE layer of ``model`` records the experts each forward chooses (``routes`` None: yields the
    record, layer name -> one tensor a forward), or takes the recorded ones in turn instead of its own top-k (the
    weights still its router's, for those experts). An export check compares a reloaded model with the one written
    this way: a router logit a rounding away from a tie would otherwise pick another expert, and the comparison
    would measure that, not the weights."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    record = {name: list(routes.get(name, [])) if routes is not None else [] for name in layers}
    for name, layer in layers.items():
        layer.routes, layer.replaying = record[name], routes is not None
    try:
        yield record
    finally:
        for layer in layers.values():
            layer.routes, layer.replaying = None, False
