"""The recipes under torchrun on CPU (Gloo): the same losses as one process with the same global batch,
sharded DCP checkpoints that resume on another number of processes, and the final export in the
input's format, bitwise the single-process one, with rank 0 holding about one output file at a time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from waypoint.checkpointers.commit import verify
from waypoint.checkpointers.file_formats import read_tensors
from tests.launch import FileSizeLimit, launch
from tests.recipe_runs import Finished, run_recipe, run_script
from tests.test_resume import tiny_in_format

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH, EPOCHS = 4, 2
FINAL = f"step_{STEPS_PER_EPOCH * EPOCHS}"
BASE = [f"epochs={EPOCHS}", f"max_steps_per_epoch={STEPS_PER_EPOCH}", "save_every_n_steps=2", "keep_last_n_checkpoints=null",
        f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}"]
GLOBAL_BATCH = 8
LOSS_TOLERANCE = 2e-6  # one process vs two: the same sums in another order (measured: 7e-7)
WEIGHT_TOLERANCE = 2e-5  # after 8 AdamW steps at lr 3e-3 (measured: 3e-6)


def run(out: Path, *overrides: str, processes: int = 1, fault: list[str] | None = None,
        source: Path | None = None, recipe: str = "full", env: dict | None = None, torchrun: bool = False) -> Finished:
    """A recipe (``full`` or ``lora``) on ``processes`` CPU processes, global batch 8: ranks forked as torchrun starts
    them (``tests/recipe_runs.py``), or with ``torchrun`` under a real one, whose report and stopping of the other
    ranks when one is killed are what a test checks."""
    overrides = (f"checkpointer.checkpoint_dir={source or ROOT / 'assets/tiny_llama'}",
                 f"batch_size={GLOBAL_BATCH // processes}", *overrides)
    config = ROOT / ("configs/tiny.yaml" if recipe == "full" else "configs/tiny_lora.yaml")
    args = ["--config", str(config), f"output_dir={out}", *BASE, *overrides]
    if not torchrun:
        return run_recipe(recipe, args, fault=fault, env=env, processes=processes)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    script = [str(ROOT / "tests/interrupt.py"), *fault, "--"] if fault else [str(ROOT / f"recipes/{recipe}_finetune.py")]
    done = subprocess.run([*launcher, *script, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "INTERRUPT_RECIPE": recipe, **(env or {})})
    return Finished(done.returncode, done.stdout, done.stderr)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(step_dir: Path) -> dict[str, torch.Tensor]:
    merged = {}
    for f in sorted(step_dir.glob("*.safetensors")):
        merged.update(read_tensors(f))
    return merged


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def weight_files(step_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir())
            if p.name.endswith((".safetensors", ".pth")) or p.name.endswith(".index.json")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    result = run(out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    result = run(out, processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(one_process, two_processes):
    one, two = losses(one_process), losses(two_processes)
    assert len(one) == len(two) == STEPS_PER_EPOCH * EPOCHS
    assert max(abs(a - b) for a, b in zip(one, two)) < LOSS_TOLERANCE, (one, two)
    assert max_diff(weights(one_process / FINAL), weights(two_processes / FINAL)) < WEIGHT_TOLERANCE
    # Intermediate checkpoints are sharded (DCP, one file per rank) and verified; the final one is in the
    # input's format, names and key -> file map, with the optimizer's shards beside it.
    for step in (2, 4, 6):
        step_dir = two_processes / f"step_{step}"
        assert verify(step_dir).ok
        manifest = json.loads((step_dir / "MANIFEST.json").read_text())["files"]
        assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/.metadata", "recipe_state.pt"} <= manifest.keys()
        assert not list(step_dir.glob("*.safetensors"))
    final = two_processes / FINAL
    assert verify(final).ok
    source = ROOT / "assets/tiny_llama"
    assert sorted(p.name for p in final.glob("*.safetensors")) == sorted(p.name for p in source.glob("*.safetensors"))
    index = lambda d: json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
    assert index(final) == index(source)
    state = torch.load(final / "recipe_state.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng_per_rank"]) == 2 and state["optimizer"] is None


@pytest.mark.slow
def test_killed_run_resumes_on_two_processes_and_on_one(tmp_path, one_process, two_processes):
    """Rank 0 SIGKILLed after step 5 (async saves: step_4 may still be in flight) and torchrun stopping
    rank 1, then the same command on 2 processes, or on 1 with the same global batch."""
    killed = tmp_path / "killed"
    result = run(killed, "async_checkpoint=true", processes=2, fault=["kill-group-at-step", "5", "-"], torchrun=True)
    assert result.returncode != 0 and "Signal 9 (SIGKILL) received" in result.stderr, result.stderr[-3000:]
    assert (killed / "step_2").is_dir() and not (killed / "step_6").exists()

    again = shutil.copytree(killed, tmp_path / "again")
    resumed = run(again, "async_checkpoint=true", processes=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step_" in resumed.stdout and "training blocked" in resumed.stdout
    assert losses(again) == losses(two_processes), "the same 2 processes resumed must retrace the run exactly"
    assert weight_files(again / FINAL) == weight_files(two_processes / FINAL)
    assert not list(again.glob(".step_*")), "the killed save's staging directory was left behind"

    alone = shutil.copytree(killed, tmp_path / "alone")
    resumed = run(alone)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "note: 2 -> 1 processes" in resumed.stdout
    mine, theirs = losses(alone), losses(two_processes)
    assert len(mine) == len(theirs) and max(abs(a - b) for a, b in zip(mine, theirs)) < LOSS_TOLERANCE
    assert max_diff(weights(alone / FINAL), weights(two_processes / FINAL)) < WEIGHT_TOLERANCE
    assert verify(alone / FINAL).ok and not (alone / FINAL / "sharded").exists()  # one process writes whole tensors


def back_to_step(run_dir: Path, copy: Path, step: int) -> Path:
    """A copy of a finished run as it was after step ``step``'s checkpoint."""
    out = shutil.copytree(run_dir, copy)
    for later in range(step + 2, STEPS_PER_EPOCH * EPOCHS + 1, 2):
        shutil.rmtree(out / f"step_{later}")
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:step]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("before,after,step", [(1, 2, 4), (2, 4, 6)], ids=["1-to-2", "2-to-4"])
def test_checkpoint_resumes_on_more_processes(tmp_path, one_process, two_processes, before, after, step):
    """One process's whole tensors onto two ranks' shards (4 steps to go); two ranks' DCP shards onto four ranks (the
    last 2 steps: four processes on this machine's two cores are its slowest run)."""
    reference = {1: one_process, 2: two_processes}[before]
    out = back_to_step(reference, tmp_path / "run", step)
    result = run(out, processes=after)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from step_{step}" in result.stdout and f"note: {before} -> {after} processes" in result.stdout
    mine, theirs = losses(out), losses(reference)
    assert mine[:step] == theirs[:step] and max(abs(a - b) for a, b in zip(mine, theirs)) < LOSS_TOLERANCE
    assert len(mine) == len(theirs)
    assert max_diff(weights(out / FINAL), weights(reference / FINAL)) < WEIGHT_TOLERANCE


@pytest.mark.slow
def test_sharded_step_converts_to_the_input_format(tmp_path, one_process, two_processes):
    """scripts/convert.py reads a sharded intermediate checkpoint into the run's input format and files."""
    out = tmp_path / "step_6_hf"
    result = run_script("convert", [str(two_processes / "step_6"), str(out), "--to", "hf"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert verify(out).ok
    source = ROOT / "assets/tiny_llama"
    index = lambda d: json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
    assert index(out) == index(source)
    assert max_diff(weights(out), weights(one_process / "step_6")) < WEIGHT_TOLERANCE


def test_inspect_shows_a_sharded_step(two_processes, capsys):
    """scripts/inspect.py reads a torchrun intermediate step like any checkpoint: its model keys from DCP's
    metadata, its files, the run's input, the manifest."""
    from scripts import inspect as inspect_script

    assert inspect_script.main([str(two_processes / "step_6")]) == 0
    out = capsys.readouterr().out
    assert "sharded step checkpoint of a 2-process torchrun run (DCP), step 6" in out and "2 shard file(s)" in out
    assert "layers.{0..3}.mlp.w1.weight" in out and "[352, 128]" in out and "total: 869,504 parameters" in out
    assert "manifest: verified" in out


def test_generate_reads_a_sharded_step(two_processes, tmp_path):
    """recipes/generate.py talks to a torchrun intermediate step as to any checkpoint: the model it builds from the
    shards is bitwise the one from that step converted to the input's format, and it replies."""
    from omegaconf import OmegaConf

    from recipes import generate
    from scripts import convert

    assert convert.main([str(two_processes / "step_6"), str(tmp_path / "hf"), "--to", "hf", "--no-verify"]) == 0
    models = [generate.load(OmegaConf.create({"checkpoint_dir": str(d), "dtype": "fp32", "device": "cpu"}))
              for d in (two_processes / "step_6", tmp_path / "hf")]
    (sharded, tokenizer_dir), (converted, _) = models
    assert tokenizer_dir == ROOT / "assets/tiny_llama"  # the run's input: a sharded step has no tokenizer of its own
    mine, theirs = sharded.state_dict(), converted.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert generate.main(["--config", str(ROOT / "configs/generate.yaml"), f"checkpoint_dir={two_processes / 'step_6'}",
                          "prompt=Hi", "max_new_tokens=4"]) == 0


@pytest.mark.slow
def test_mixed_precision_computes_in_bf16_over_fp32_shards(tmp_path, two_processes):
    """The fp32 run's first 3 steps in bf16 compute, then the export: fp32 weights, as the input's."""
    out = tmp_path / "bf16"
    result = run(out, "mixed_precision={param_dtype: bf16, reduce_dtype: fp32}", "epochs=1", "max_steps_per_epoch=3",
                 "save_every_n_steps=null", processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    gaps = [abs(a - b) for a, b in zip(losses(out), losses(two_processes))]
    assert len(gaps) == 3 and 1e-5 < max(gaps) < 2e-2, gaps  # bf16 compute (measured: 1.0e-4 to 5.4e-4), not the fp32 run
    assert {t.dtype for t in weights(out / "step_3").values()} == {torch.float32}
    assert json.loads((out / "step_3" / "config.json").read_text())["dtype"] == "float32"


def tied_qwen2(path: Path) -> Path:
    """A tiny Qwen2 with tied embeddings (no lm_head in its file), sharing the tiny tokenizer."""
    from tests.conftest import tiny_family_config, write_family_checkpoint

    source = ROOT / "assets/tiny_llama"
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    write_family_checkpoint(path, tiny_family_config("qwen2", vocab_size=vocab, tie_word_embeddings=True), max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hf", "meta", "qwen2-tied"])
def test_export_from_two_ranks_is_bitwise_the_single_process_one(tmp_path, fmt):
    """With lr 0 the weights stay the input's: the 2-process export must be its files, byte for byte (as one
    process's save is: tests/test_hf_checkpointer.py), and for Meta's pickles, whose framing differs from the test's
    own, key for key and the single-process export's bytes."""
    source = tied_qwen2(tmp_path / "qwen2") if fmt == "qwen2-tied" else tiny_in_format(fmt, tmp_path)
    fmt = "hf" if fmt == "qwen2-tied" else fmt
    still = ["optimizer.lr=0", "epochs=1", "max_steps_per_epoch=1", f"checkpointer={fmt}"]
    one, two = tmp_path / "one", tmp_path / "two"
    for out, processes in ((one, 1), (two, 2)) if fmt == "meta" else ((two, 2),):
        result = run(out, *still, processes=processes, source=source)
        assert result.returncode == 0, result.stderr[-3000:]
    exported = weight_files(two / "step_1")
    assert exported and (fmt != "meta" or exported == weight_files(one / "step_1"))
    assert exported.keys() == weight_files(source).keys()
    for name in exported:  # the input's files, key for key (HF: byte for byte; the test's Meta pickles differ in framing)
        if name.endswith(".json"):
            assert exported[name] == (source / name).read_bytes()
            continue
        mine, theirs = read_tensors(two / "step_1" / name), read_tensors(source / name)
        assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
        if fmt == "hf":
            assert exported[name] == (source / name).read_bytes()


@pytest.mark.slow
def test_rank_zero_export_memory_is_about_one_file(tmp_path):
    """A 145 MB model in 6 files: rank 0's peak RSS while exporting rises by about one file, far below the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=8000, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model", max_shard_size="32MB")
    # two ranks forked as torchrun starts them: the probe resets rank 0's peak RSS itself, so what the fork shares
    # with the launch server is in its 'before' as much as in its peak
    code, stdout, stderr, _ = launch(str(ROOT / "tests/export_memory_probe.py"), [str(tmp_path / "model"), str(tmp_path / "out")],
                                     processes=2)
    assert code == 0, stderr[-3000:]
    figures = json.loads(stdout.strip().splitlines()[-1])
    rise = figures["rss_peak"] - figures["rss_before"]
    print(f"model {figures['model_bytes'] / 1e6:.0f} MB, largest file {figures['largest_file'] / 1e6:.0f} MB, "
          f"rank 0 RSS rise during export {rise / 1e6:.0f} MB")
    assert figures["model_bytes"] > 4 * figures["largest_file"], "the model must be several files for this to tell"
    assert rise < figures["model_bytes"] / 2
    assert rise < 2 * figures["largest_file"]
    assert weight_files(tmp_path / "out/step_1") == weight_files(tmp_path / "model")


@pytest.mark.slow
def test_lora_on_two_processes_matches_one_and_resumes_on_one(tmp_path):
    """LoRA on a sharded base: the same losses, adapters and merged model as one process; the 2-process run's
    directory as it stood after step_2 (that step's shards) resumed on 1, the adapter and merged files equal the
    2-process run's within the same tolerance. A kill's part (the other rank stopped, nothing later committed) is
    test_killed_run_resumes_on_two_processes_and_on_one's."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert run(one, recipe="lora").returncode == 0
    result = run(two, processes=2, recipe="lora")
    assert result.returncode == 0, result.stderr[-3000:]
    assert max(abs(a - b) for a, b in zip(losses(one), losses(two))) < LOSS_TOLERANCE
    adapter = lambda out: read_tensors(out / FINAL / "adapter_model.safetensors")  # noqa: E731
    assert max_diff(adapter(one), adapter(two)) < WEIGHT_TOLERANCE
    assert max_diff(weights(one / FINAL / "merged"), weights(two / FINAL / "merged")) < WEIGHT_TOLERANCE
    merged = two / FINAL / "merged"
    assert verify(merged).ok and sorted(p.name for p in merged.glob("*.safetensors")) == sorted(
        p.name for p in (ROOT / "assets/tiny_llama").glob("*.safetensors"))

    stopped = back_to_step(two, tmp_path / "stopped", 2)
    resumed = run(stopped, recipe="lora")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step_2" in resumed.stdout and "note: 2 -> 1 processes" in resumed.stdout
    assert max(abs(a - b) for a, b in zip(losses(stopped), losses(two))) < LOSS_TOLERANCE
    assert max_diff(adapter(stopped), adapter(two)) < WEIGHT_TOLERANCE


@pytest.mark.slow
def test_qlora_on_two_processes_matches_one(tmp_path):
    """NF4 base weights shard with FSDP2 (torchao's NF4Tensor all-gathers its 4-bit data and scales over Gloo too):
    each rank holds its rows of the whole tensor's quantization, so 2 processes compute what 1 does."""
    qlora = ("+quantize_base=nf4", "+nf4.scaler_block_size=8", "save_merged=final", "epochs=1")  # 4 steps
    one, two = tmp_path / "one", tmp_path / "two"
    assert run(one, *qlora, recipe="lora").returncode == 0
    result = run(two, *qlora, processes=2, recipe="lora")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "quantized to NF4 as loaded: 28 tensors" in result.stdout  # sharded: each rank holds NF4 rows
    assert max(abs(a - b) for a, b in zip(losses(one), losses(two))) < LOSS_TOLERANCE
    final = f"step_{STEPS_PER_EPOCH}"
    adapter = lambda out: read_tensors(out / final / "adapter_model.safetensors")  # noqa: E731
    assert max_diff(adapter(one), adapter(two)) < WEIGHT_TOLERANCE
    assert max_diff(weights(one / final / "merged"), weights(two / final / "merged")) < WEIGHT_TOLERANCE


@pytest.mark.slow
def test_moe_on_two_processes_matches_one(tmp_path):
    """Mixtral's stacked experts shard with FSDP2 like any weight (expert parallelism aside): the same losses,
    load-balancing losses and validation losses (each rank evaluating its share) as one process, and the final
    export in the input's per-expert files and key map."""
    from tests.test_family_training import base_checkpoint

    base = base_checkpoint(tmp_path / "base", "mixtral")
    one, two = tmp_path / "one", tmp_path / "two"
    for out, processes in ((one, 1), (two, 2)):
        result = run(out, "epochs=1", "save_every_n_steps=null", "validation={fraction: 0.05, every_n_steps: 2}", source=base,
                     processes=processes)
        assert result.returncode == 0, result.stderr[-3000:]
    records = lambda out: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    steps = lambda out: [r for r in records(out) if "loss" in r]  # noqa: E731
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(steps(one), steps(two))) < LOSS_TOLERANCE
    assert max(abs(a["aux_loss"] - b["aux_loss"]) for a, b in zip(steps(one), steps(two))) < LOSS_TOLERANCE
    val = lambda out: [r["val_loss"] for r in records(out) if "val_loss" in r]  # noqa: E731
    assert len(val(one)) == 2 and max(abs(a - b) for a, b in zip(val(one), val(two))) < LOSS_TOLERANCE
    final = f"step_{STEPS_PER_EPOCH}"
    assert max_diff(weights(one / final), weights(two / final)) < WEIGHT_TOLERANCE
    index = lambda d: json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
    assert index(two / final) == index(base) and any(".experts.3.w2.weight" in k for k in index(base))


# -- pieces, in one process ----------------------------------------------------------------------

def test_sharded_checkpoint_round_trip_in_one_process(tmp_path):
    from waypoint.checkpointers.sharded_checkpoint import holds_sharded_model, load_sharded, save_sharded, sharded_keys

    state = {"model": {"w": torch.randn(6, 4)}, "optimizer": {"w": {"exp_avg": torch.randn(6, 4), "step": torch.tensor(3.0)}}}
    save_sharded(state, tmp_path / "step_1/sharded")
    assert sharded_keys(tmp_path / "step_1/sharded") == {"model.w", "optimizer.w.exp_avg", "optimizer.w.step"}
    assert holds_sharded_model(tmp_path / "step_1")
    empty = {"model": {"w": torch.zeros(6, 4)}, "optimizer": {"w": {"exp_avg": torch.zeros(6, 4), "step": torch.tensor(0.0)}}}
    load_sharded(empty, tmp_path / "step_1/sharded")
    assert torch.equal(empty["model"]["w"], state["model"]["w"]) and empty["optimizer"]["w"]["step"].item() == 3.0
    with pytest.raises(Exception, match="tensors only"):
        save_sharded({"model": {"note": "text"}}, tmp_path / "other")


def test_sharded_metadata_is_data_never_code(tmp_path):
    """DCP unpickles .metadata with pickle.load; ours allows DCP's plain classes only."""
    import pickle

    from waypoint.checkpointers.sharded_checkpoint import load_sharded, save_sharded
    from waypoint.errors import CheckpointError

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    save_sharded({"model": {"w": torch.ones(2)}}, tmp_path / "ok")
    (tmp_path / "evil").mkdir()
    shutil.copy(tmp_path / "ok/__0_0.distcp", tmp_path / "evil/__0_0.distcp")
    (tmp_path / "evil/.metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable sharded checkpoint metadata .*system"):
        load_sharded({"model": {"w": torch.zeros(2)}}, tmp_path / "evil")
    assert not (tmp_path / "pwned").exists()

    # A tensor entry declared as pickled bytes would be torch.load-ed with weights_only=False by DCP: refused.
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from waypoint.checkpointers.sharded_checkpoint import read_metadata
    metadata = read_metadata(tmp_path / "ok")
    metadata.state_dict_metadata["model.w"] = BytesStorageMetadata()
    (tmp_path / "evil/.metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="BytesStorageMetadata is not part of DCP's metadata"):
        load_sharded({"model": {"w": torch.zeros(2)}}, tmp_path / "evil")


def test_ranks_split_each_global_batch_in_order():
    from waypoint.data.data_order import iterate_batches

    dataset = list(range(50))
    whole = [b for _, b in iterate_batches(dataset, 8, seed=3, epoch=1, collate_fn=list, start_batch=2)]
    parts = [[b for _, b in iterate_batches(dataset, 4, seed=3, epoch=1, collate_fn=list, start_batch=2, rank=r, world_size=2)]
             for r in range(2)]
    assert len(whole) == len(parts[0]) == len(parts[1]) == 50 // 8 - 2
    assert all(a + b == w for a, b, w in zip(parts[0], parts[1], whole))
    with pytest.raises(ValueError, match="rank must be in"):
        iterate_batches(dataset, 4, seed=3, epoch=0, collate_fn=list, rank=2, world_size=2)


def test_manifest_entries_stay_inside_their_directory(tmp_path):
    from waypoint.checkpointers.commit import StagedDir
    from waypoint.errors import CheckpointError

    with StagedDir(tmp_path / "step_1") as stage:
        (stage.path / "sharded").mkdir()
        (stage.path / "sharded/a.distcp").write_bytes(b"abc")
        from waypoint.checkpointers.commit import hash_file
        stage.adopt("sharded/a.distcp", *hash_file(stage.path / "sharded/a.distcp"))
        for bad in ("../outside", "/etc/passwd", "sharded/../../x", ""):
            with pytest.raises(CheckpointError, match="cannot stage file"):
                stage.adopt(bad, 1, "0")
    assert verify(tmp_path / "step_1").ok
    manifest = json.loads((tmp_path / "step_1/MANIFEST.json").read_text())
    manifest["files"]["../step_1/MANIFEST.json"] = manifest["files"].pop("sharded/a.distcp")
    (tmp_path / "step_1/MANIFEST.json").write_text(json.dumps(manifest))
    assert "outside the checkpoint" in verify(tmp_path / "step_1").problem


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", ["true", "false"])
def test_disk_full_during_a_sharded_save_stops_every_rank_cleanly(tmp_path, asynchronous):
    """Writes past 1 MB fail (RLIMIT_FSIZE) on both ranks: one error line per rank, nothing committed, no
    staging directory left, and no rank left waiting (an asynchronous save's failure surfaces at the next save)."""
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={out}", *BASE, "batch_size=4",
            f"async_checkpoint={asynchronous}"]
    result = run_recipe("full", args, processes=2, preexec_fn=FileSizeLimit(1_000_000), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error: could not write" in line]
    assert len(errors) == 2 and all(f"{out}/step_2: " in e and "earlier checkpoints are intact" in e for e in errors), errors
    assert not list(out.glob("step_*")) and not list(out.glob(".step_*"))
