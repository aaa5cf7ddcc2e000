"""Qwen3.5's multimodal RoPE (mRoPE): each token has three positions, time, height and width, and each rotary
frequency reads one of them, interleaved (``mrope_section`` [11, 11, 10]: frequency f reads height if f % 3 == 1 and
f < 3 * 11, width if f % 3 == 2 and f < 3 * 10, else time). Text tokens have the same position on all three, which
makes it the plain rotation; an image's tokens take their row and column in its merged grid, offset by the position
it starts at, and the text after it goes on from the image's largest position + 1 (transformers' ``get_rope_index``:
the sequence then uses fewer positions than tokens, the difference kept as the ``delta`` a generation's later tokens add)."""

from __future__ import annotations

import torch


def mrope_positions(token_types: torch.Tensor, image_grid_thw: torch.Tensor, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([3, batch, seq] positions, [batch] deltas) for ``token_types`` [batch, seq] (1 on image tokens, as the
    processor's ``mm_token_type_ids``) and each image's patch grid ``image_grid_thw`` [images, 3], in order."""
    grids = iter(image_grid_thw.tolist())
    rows, deltas = [], []
    for types in token_types.tolist():
        parts, current, start = [], 0, 0
        while start < len(types):
            end = start
            while end < len(types) and types[end] == types[start]:
                end += 1
            if types[start] == 1:
                t, h, w = next(grids)
                h, w = h // merge_size, w // merge_size
                grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
                parts.append(grid.reshape(3, -1) + current)
                if parts[-1].shape[1] != end - start:
                    raise ValueError(f"an image of {t}x{h}x{w} merged patches has {end - start} image tokens in the text")
                current += max(h, w)
            else:
                parts.append(torch.arange(current, current + end - start).expand(3, -1))
                current += end - start
            start = end
        row = torch.cat(parts, dim=1)
        rows.append(row)
        deltas.append(int(row.max()) + 1 - len(types))
    return torch.stack(rows, dim=1).to(token_types.device), torch.tensor(deltas, device=token_types.device)


def mrope_axes(n_frequencies: int, section: tuple[int, ...]) -> torch.Tensor:
    """[n_frequencies] long: the position (0 time, 1 height, 2 width) each rotary frequency reads."""
    axes = torch.zeros(n_frequencies, dtype=torch.long)
    for axis in (1, 2):
        axes[axis: 3 * section[axis]: 3] = axis
    return axes


def mrope_rows(table: torch.Tensor, positions: torch.Tensor, section: tuple[int, ...]) -> torch.Tensor:
    """Each token's rotary rows [batch, seq, frequencies, 2] from the plain table [max_seq, frequencies, 2]: frequency
    f at the token's position on its axis (the same bits as transformers' cos/sin of that position)."""
    n = table.shape[1]
    axes = mrope_axes(n, section).to(positions.device)
    chosen = positions[axes]  # [frequencies, batch, seq]: each frequency's axis
    return table[chosen.permute(1, 2, 0), torch.arange(n, device=positions.device)]
