"""scripts/bench_train.py, each row run in this process on a tiny shape: the rows that build our model on the same batch
start from the same loss, and every row reports its figures."""

from __future__ import annotations

import math

import pytest

from scripts import bench_train

TINY = (512, 32, 64, 2, 4, 2, 2, 32)  # vocab, hidden, intermediate, layers, heads, kv heads, batch, seq


def test_every_row_reports_and_ours_start_from_one_loss(monkeypatch):
    monkeypatch.setitem(bench_train.SHAPES, "tiny", TINY)
    monkeypatch.setitem(bench_train.PROMPT, "tiny", 0.5)  # as the chat shape: half of each sequence a prompt
    rows = {impl: bench_train.child(impl, "tiny", 1, "cpu", "fp32")
            for impl in ("ours", "ours-plain", "ours-ac", "ours-fused-adamw", "transformers")}
    for impl in ("ours-plain", "ours-ac", "ours-fused-adamw"):  # the same model and batch, another path
        assert rows[impl]["first_loss"] == pytest.approx(rows["ours"]["first_loss"], rel=1e-6), impl
    assert abs(rows["ours"]["first_loss"] - math.log(512)) < 0.5  # a fresh model: about uniform over the vocabulary
    for impl, row in rows.items():
        assert row["tokens"] == 64 and row["median_s"] > 0 and row["peak_gb"] > 0 and row["faults"] >= 0, impl
        assert math.isfinite(row["first_loss"]), impl
