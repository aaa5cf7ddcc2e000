"""Batching variable-length items: right padding to the longest one."""

from __future__ import annotations

import torch

from waypoint.models.fused_loss import IGNORE_INDEX


def padded_collate(batch: list[dict], pad_id: int, ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """``{"tokens", "labels"}`` items -> LongTensors [batch, longest], tokens padded with ``pad_id``
    and labels with ``ignore_index`` on the right, and ``mask`` [batch, longest], True on the items' own tokens
    (a MoE model's load-balancing loss counts those, as transformers does with the attention mask). Packed items'
    ``positions`` and ``document_ids`` are padded with 0 and -1 (the padding is a document of its own)."""
    if not batch:
        raise ValueError("padded_collate: empty batch")
    longest = max(len(item["tokens"]) for item in batch)
    tokens = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), ignore_index, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.bool)
    packed = {key: torch.full((len(batch), longest), fill, dtype=torch.long)
              for key, fill in (("positions", 0), ("document_ids", -1)) if key in batch[0]}
    for row, item in enumerate(batch):
        if len(item["labels"]) != len(item["tokens"]):
            raise ValueError(f"padded_collate: item {row} has {len(item['tokens'])} tokens "
                             f"but {len(item['labels'])} labels")
        n = len(item["tokens"])
        tokens[row, :n] = torch.as_tensor(item["tokens"], dtype=torch.long)
        labels[row, :n] = torch.as_tensor(item["labels"], dtype=torch.long)
        mask[row, :n] = True
        for key, values in packed.items():
            values[row, :n] = torch.as_tensor(item[key], dtype=torch.long)
    return {"tokens": tokens, "labels": labels, "mask": mask, **packed}


def preference_collate(pairs: list[dict], pad_id: int, ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """``{"prompt", "chosen", "rejected"}`` pairs (token ids) -> one batch of 2 x pairs rows in TRL's concatenated
    order: rows ``0..B-1`` prompt + chosen, rows ``B..2B-1`` prompt + rejected, right-padded with ``pad_id`` to the
    longest. ``tokens`` and ``labels`` LongTensors [2B, longest] (labels: the completion's tokens where they are,
    ``ignore_index`` on the prompt and the padding, so ``labels[:, 1:]`` are what a next-token loss predicts),
    ``mask`` [2B, longest] True on the rows' own tokens, and ``completion_tokens`` [2B]: each row's number of
    completion tokens (IPO and SimPO average by it)."""
    if not pairs:
        raise ValueError("preference_collate: empty batch")
    rows, completions = [], []
    for side in ("chosen", "rejected"):
        for pair in pairs:
            rows.append((pair["prompt"], pair[side]))
            completions.append(len(pair[side]))
    longest = max(len(prompt) + len(completion) for prompt, completion in rows)
    tokens = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), ignore_index, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool)
    for row, (prompt, completion) in enumerate(rows):
        n_prompt, n = len(prompt), len(prompt) + len(completion)
        tokens[row, :n_prompt] = torch.as_tensor(prompt, dtype=torch.long)
        tokens[row, n_prompt:n] = torch.as_tensor(completion, dtype=torch.long)
        labels[row, n_prompt:n] = tokens[row, n_prompt:n]
        mask[row, :n] = True
    return {"tokens": tokens, "labels": labels, "mask": mask,
            "completion_tokens": torch.tensor(completions, dtype=torch.long)}


def vision_collate(batch: list[dict], pad_id: int, ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """``padded_collate`` of a vision-language dataset's items (``{"tokens", "labels", "pixel_values"}``, the token
    types under the family's name, ``token_type_ids`` or ``mm_token_type_ids``, and Qwen's ``image_grid_thw``), plus
    ``pixel_values``: every item's concatenated along the first dimension, in order, float32 (Gemma 3's images
    [images, 3, H, W], Qwen's patches [patches, C*T*P*P]: the model puts the i-th image's features at the i-th run
    of image tokens of the batch, row by row); ``image_grid_thw`` concatenated the same way, when the items have
    it (a batch of Qwen's without any image has neither, as its processor gives none), and Gemma 4's
    ``image_position_ids`` likewise; and the token types,
    LongTensor [batch, longest] under their own name, padded with 0 (not an image token)."""
    out = padded_collate(batch, pad_id, ignore_index)
    key = next((k for k in ("token_type_ids", "mm_token_type_ids") if k in batch[0]), None)
    if key is None:
        raise ValueError("vision_collate: the items have no token_type_ids or mm_token_type_ids")
    token_types = torch.zeros_like(out["tokens"])
    for row, item in enumerate(batch):
        if key not in item or len(item[key]) != len(item["tokens"]):
            raise ValueError(f"vision_collate: item {row} has {len(item['tokens'])} tokens "
                             f"but {len(item.get(key, ()))} {key}")
        token_types[row, : len(item["tokens"])] = torch.as_tensor(item[key], dtype=torch.long)
    pixels = [item["pixel_values"] for item in batch]
    shapes = {tuple(p.shape[1:]) for p in pixels if p.shape[0]}
    if len(shapes) > 1:
        raise ValueError(f"vision_collate: images of different sizes in one batch ({sorted(shapes)})")
    out[key] = token_types
    if "image_grid_thw" in batch[0]:
        grids = torch.cat([torch.as_tensor(item["image_grid_thw"], dtype=torch.long).reshape(-1, 3) for item in batch])
        if not len(grids):  # as Qwen's processor: no image inputs without images (its tower takes at least one)
            return out
        out["image_grid_thw"] = grids
    if "image_position_ids" in batch[0]:  # Gemma 4's: each image's patches' (x, y), padded as its pixel values
        out["image_position_ids"] = torch.cat([torch.as_tensor(item["image_position_ids"]) for item in batch], dim=0)
    out["pixel_values"] = torch.cat([p.to(torch.float32) for p in pixels], dim=0)
    return out


def batch_collate(batch: list[dict], pad_id: int, ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """The collate for whatever the items are: ``vision_collate`` for items with images, ``padded_collate`` else."""
    return (vision_collate if batch and "pixel_values" in batch[0] else padded_collate)(batch, pad_id, ignore_index)
