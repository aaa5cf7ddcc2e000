"""benchmarks/bench_train.py, each row run in this process on a tiny shape: the rows that build our model on the same batch
start from the same loss, and every row reports its figures."""

from __future__ import annotations

import math

import pytest

from benchmarks import bench_train

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


def test_the_hybrid_shape_builds_qwen3_5_on_both_sides(monkeypatch):
    """The qwen3.5 shape's rows build Qwen3.5's hybrid layers: ours and transformers' Qwen3_5ForCausalLM, each a fresh
    model about uniform over the vocabulary."""
    monkeypatch.setitem(bench_train.SHAPES, "tiny-hybrid", (512, 32, 64, 4, 4, 2, 2, 80))
    monkeypatch.setitem(bench_train.HYBRID, "tiny-hybrid", dict(bench_train.HYBRID["qwen3.5"], head_dim=8, linear_key_head_dim=8,
                                                                linear_value_head_dim=8))
    config = bench_train.hf_config("tiny-hybrid")
    assert config["model_type"] == "qwen3_5_text" and config["linear_num_value_heads"] == 8
    for impl in ("ours", "transformers"):
        row = bench_train.child(impl, "tiny-hybrid", 1, "cpu", "fp32")
        assert row["tokens"] == 160 and abs(row["first_loss"] - math.log(512)) < 0.5, impl
    from waypoint.families import from_hf_config

    assert from_hf_config(config).args.linear_attention_layers == (0, 1, 2)
