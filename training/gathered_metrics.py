"""Metrics gathered from every micro-batch of every rank, reduced to one value each as TRL reduces its gathers."""

from __future__ import annotations

import torch


def reduce_gathered(records: list[dict[str, float]], nan_skipping_means: tuple[str, ...] = ()) -> dict[str, float]:
    """``records`` (the same keys in each) as one: a key ending ``_min`` or ``/min`` their least, ``_max`` or ``/max``
    their greatest (NaN, a micro-batch with nothing to measure, left out), any other their mean; the mean leaves NaN
    out too for keys starting with one of ``nan_skipping_means``. All NaN: NaN."""
    out = {}
    for key in records[0] if records else ():
        values = torch.tensor([r[key] for r in records], dtype=torch.float64)
        kept = values[~torch.isnan(values)]
        if key.endswith(("_min", "/min")):
            out[key] = float(kept.min()) if kept.numel() else float("nan")
        elif key.endswith(("_max", "/max")):
            out[key] = float(kept.max()) if kept.numel() else float("nan")
        elif key.startswith(nan_skipping_means):
            out[key] = float(kept.mean()) if kept.numel() else float("nan")
        else:
            out[key] = float(values.mean())
    return out
