"""Where a vision-language model's images enter the text: the projected image embeddings in place of the image
tokens' embeddings, and the attention mask under which an image's tokens see each other both ways (Gemma 3).

Both follow transformers: the embeddings replace the (already scaled) token embeddings row for row, in order
(``masked_scatter``); an image is a run of consecutive tokens whose ``token_type_ids`` are 1, and a query in it
attends every key of its run as well as the causal past; a sliding layer keeps its window on top
(``create_masks_for_vision_model``: AND(window, OR(causal, image))). Gemma 4 looks every placeholder (image, video,
audio) up as the pad token first (``placeholders_as``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def place_images(h: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``h`` [batch, seq, dim] with the rows at ``image_token_id`` replaced, in order, by the rows of ``features``
    (Gemma 3's [images, tokens_per_image, dim], Qwen3.5's [tokens, dim]); a count that does not match is a one-line
    error."""
    where = tokens == image_token_id
    if int(where.sum()) * h.shape[-1] != features.numel():
        raise ValueError(f"{int(where.sum())} image tokens for {features.numel() // h.shape[-1]} image embeddings: the "
                         "text and the images do not match (was an image cut off by max_seq_len?)")
    return h.masked_scatter(where.unsqueeze(-1), features.to(h.dtype))


def placeholders_as(tokens: torch.Tensor, placeholder_ids: tuple[int, ...], pad_id: int) -> torch.Tensor:
    """``tokens`` with every placeholder (image, video, audio token) replaced by ``pad_id``: what Gemma 4 looks up in
    its embeddings and per-layer embeddings (transformers' ``Gemma4Model``), with its media or without."""
    if not placeholder_ids:
        return tokens
    ids = torch.tensor(placeholder_ids, dtype=tokens.dtype, device=tokens.device)
    return tokens.masked_fill(torch.isin(tokens, ids), pad_id)


def image_groups(token_type_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] long: each image token's image (0, 1, ... in its row), -1 for text."""
    is_image = token_type_ids == 1
    starts = is_image & ~F.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(1) - 1, -1)


def image_mask(token_type_ids: torch.Tensor, window: int | None = None, document_ids: torch.Tensor | None = None,
               past: int = 0) -> torch.Tensor:
    """[batch, 1, seq, past + seq] bool: causal (over ``past`` cached positions too), within a packed row's document,
    OR within the query's own image; with a ``window``, only keys ``i - window < j``."""
    seq = token_type_ids.shape[1]
    i = torch.arange(past, past + seq, device=token_type_ids.device)[:, None]
    j = torch.arange(past + seq, device=token_type_ids.device)[None, :]
    groups = image_groups(token_type_ids)
    keys = F.pad(groups, (past, 0), value=-1)  # cached positions are never in a new image
    allowed = (j <= i)[None] | ((groups[:, :, None] == keys[:, None, :]) & (groups[:, :, None] >= 0))
    if document_ids is not None:
        allowed &= document_ids[:, :, None] == document_ids[:, None, :]
    if window is not None:
        allowed &= (j > i - window)[None]
    return allowed[:, None]
