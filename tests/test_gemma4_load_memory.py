"""Gemma 4's per-layer embedding table (E2B/E4B: the model's largest tensor) is assigned from its file at load,
never materialised a second time: benchmarks/bench_ple_load.py at a test's size, and the checkpoint it writes checked
against what transformers itself writes and reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT

SMALL = dict(vocab=256, hidden=64, layers=12, per_layer_dim=8, intermediate=32, heads=2, kv_heads=1, max_positions=64,
             full_layers=False)


def test_the_bench_writes_what_save_pretrained_writes_and_transformers_reads_it(tmp_path):
    """The bench's hand-written shards hold the keys, shapes and dtype of ``Gemma4ForCausalLM.save_pretrained`` (the
    tied head left out likewise), and transformers loads them with nothing missing or left over."""
    from safetensors import safe_open
    from transformers import Gemma4ForCausalLM

    from benchmarks.bench_ple_load import config_fields, hf_config, write_checkpoint

    fields = config_fields(SimpleNamespace(**SMALL))
    info = write_checkpoint(tmp_path / "bench", fields, shard_bytes=20_000)  # several shards, the table alone in one
    assert info["files"] > 2 and info["table_shape"] == [256, 12 * 8]

    torch.manual_seed(0)
    Gemma4ForCausalLM(hf_config(fields)).to(torch.bfloat16).save_pretrained(tmp_path / "theirs")

    def tensors(path):
        out = {}
        for f in path.glob("*.safetensors"):
            with safe_open(f, framework="pt") as st:
                out.update({k: (tuple(st.get_slice(k).get_shape()), st.get_slice(k).get_dtype()) for k in st.keys()})
        return out

    assert tensors(tmp_path / "bench") == tensors(tmp_path / "theirs")
    assert json.loads((tmp_path / "bench/config.json").read_text()) == json.loads((tmp_path / "theirs/config.json").read_text())
    index = json.loads((tmp_path / "bench/model.safetensors.index.json").read_text())
    assert set(index["metadata"]) == {"total_parameters", "total_size"} and index["metadata"]["total_size"] == info["weights_gb"] * 1e9
    _, loading = Gemma4ForCausalLM.from_pretrained(tmp_path / "bench", output_loading_info=True)
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading


@pytest.mark.slow
def test_a_gemma4_load_holds_the_per_layer_embedding_table_once(monkeypatch, capsys):
    """benchmarks/bench_ple_load.py at a test's size (E4B's 42 layers x 256 table columns, 16384 rows: 0.35 GB of
    0.48 GB), loaded with load_model in a process of its own, every weight read: the peak rise stays within the
    weights + the rotary tables + the converter's q/k copies + 0.1 GB, a margin well under the table, whose storage is
    the file's mapping."""
    from benchmarks import bench_ple_load
    from tests.launch import forked_fresh_process

    monkeypatch.setattr(bench_ple_load, "fresh_process", forked_fresh_process(ROOT / "benchmarks/bench_ple_load.py"))
    bench_ple_load.main(["--vocab", "16384", "--hidden", "512", "--max-positions", "4096"])
    printed = capsys.readouterr().out
    print("\n" + "\n".join(printed.splitlines()[:-1]))  # shown with a failure, as the captured output is
    got = json.loads(printed.splitlines()[-1])
    assert got["table_shape"] == [16384, 42 * 256] and got["table_gb"] > 0.7 * got["weights_gb"]
    assert got["rise_gb"] >= 0.9 * got["weights_gb"], "the load did not read its weights"
    assert got["table_mapped_from"], "the table is not the file's memory: it was copied"
    assert got["margin_gb"] < 0.5 * got["table_gb"], "the bound would not see a second table"
    assert got["within"] and got["rise_gb"] <= got["bound_gb"], (
        f"load peak {got['rise_gb']:.3f} GB over the runtime, weights {got['weights_gb']:.3f} GB, bound {got['bound_gb']:.3f} GB")
