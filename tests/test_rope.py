"""RoPE as a complex product gives the bits of the rotation written out, forward and backward."""

from __future__ import annotations

import torch

from waypoint.models.attention import apply_rope
from waypoint.models.transformer import rope_cache


def written_out(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(x0 cos - x1 sin, x0 sin + x1 cos) for each interleaved pair, ``table`` broadcast over the heads."""
    x0, x1 = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = table[..., 0], table[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x.dtype)


def test_the_rotation_is_the_written_out_one_to_the_bit():
    torch.manual_seed(0)
    cache = rope_cache(64, 512, 10000.0)
    x = torch.randn(2, 100, 4, 64, requires_grad=True)
    positions = torch.randint(0, 512, (2, 100))
    for table, rows in ((cache, cache[:100, None]), (cache[positions], cache[positions][:, :, None])):
        mine, theirs = apply_rope(x, table), written_out(x, rows)
        assert torch.equal(mine, theirs)
        weights = torch.randn_like(mine)
        assert torch.equal(*(torch.autograd.grad((y * weights).sum(), x)[0] for y in (mine, theirs)))
    bf16 = x.detach().bfloat16()
    assert apply_rope(bf16, cache).dtype == torch.bfloat16
    assert torch.equal(apply_rope(bf16, cache), written_out(bf16, cache[:100, None]))
    low = cache.bfloat16()  # the table itself in bf16 (a model cast whole, or FSDP's mixed precision)
    assert torch.equal(apply_rope(bf16, low), written_out(bf16, low[:100, None].float()))
