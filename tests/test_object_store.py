"""Checkpoints in an object store: a real S3 API (moto's server on 127.0.0.1) through the real s3fs client.

The commit protocol (files, then the manifest), what counts as committed (a truncated object, a deleted manifest,
a missing part, a corrupt byte), retention, the lock, a step broken in the store repaired from the mirror, a
fine-tune to ``s3://`` killed during an upload and resumed bit-exactly on a machine without the local mirror (a preference run too), and
torchrun across two machines that share no disk. A store out of reach: tests/test_script_bad_input.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from waypoint.checkpointers.commit import StagedDir
from waypoint.errors import CheckpointError
from tests.conftest import ROOT
from tests.recipe_runs import Finished, run_recipe
from tests.test_resume import weights
from tests.s3_server import new_bucket, s3_server

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def endpoint():
    with s3_server() as url:
        yield url


@pytest.fixture
def store(endpoint):
    from waypoint.run.object_store import ObjectStore

    return ObjectStore(f"s3://{new_bucket()}/run")


def committed_step(tmp_path, name, files):
    with StagedDir(tmp_path / name) as stage:
        for file, data in files.items():
            stage.write_bytes(file, data)
    return tmp_path / name


def test_a_step_is_committed_by_its_manifest_and_every_object_it_lists(store, tmp_path):
    local = committed_step(tmp_path, "step_2", {"model.safetensors": os.urandom(3000), "recipe_state.pt": b"x" * 100})
    assert store.upload(local) == 3100
    assert store.check("step_2").ok and store.steps() == ["step_2"]

    fs, path = store.fs, store.path
    fs.pipe_file(path("step_2/model.safetensors"), b"short")  # a truncated object
    assert "has 5 bytes, manifest says 3000" in store.check("step_2").problem
    fs.rm_file(path("step_2/model.safetensors"))  # a missing part
    assert store.check("step_2").problem == "model.safetensors is missing"
    fs.rm_file(path("step_2/MANIFEST.json"))  # an upload that never finished
    assert "no MANIFEST.json" in store.check("step_2").problem


def test_download_verifies_every_hash(store, tmp_path):
    data = os.urandom(5000)
    store.upload(committed_step(tmp_path, "step_1", {"a.bin": data}))
    (tmp_path / "copy").mkdir()
    got = store.download("step_1", tmp_path / "copy" / "step_1")
    assert got.ok and (tmp_path / "copy/step_1/a.bin").read_bytes() == data
    store.fs.pipe_file(store.path("step_1/a.bin"), bytes([data[0] ^ 1]) + data[1:])  # same size, one bit flipped
    bad = store.download("step_1", tmp_path / "copy" / "again")
    assert not bad.ok and "does not match its hash" in bad.problem
    assert not (tmp_path / "copy/again").exists() and not list((tmp_path / "copy").glob(".*"))


def test_retention_deletes_only_committed_steps_older_than_the_newest(store, tmp_path):
    for step in (1, 2, 3):
        store.upload(committed_step(tmp_path, f"step_{step}", {"w": bytes([step]) * 10}))
    store.fs.pipe_file(store.path("step_9/w"), b"partial")  # a killed upload: never counted, never deleted
    assert store.prune(2) == ["step_1"]
    assert store.steps() == ["step_9", "step_3", "step_2"]
    # a new upload over leftover objects moves them aside first: nothing is deleted silently
    store.upload(committed_step(tmp_path, "step_9", {"w": b"z" * 10}))
    assert store.check("step_9").ok and store.fs.cat_file(store.path("step_9.partial/w")) == b"partial"


def test_one_run_per_prefix(store):
    from waypoint.run.lock import StoreLease

    first = StoreLease(store)
    first.acquire()
    second = StoreLease(store)
    second.me = second.me | {"host": "elsewhere"}
    try:
        store.fs.pipe_file(first.path, json.dumps(first.me | {"host": "node7", "expires": 4e9}).encode())
        with pytest.raises(CheckpointError, match=r"is in use by another run \(host node7, pid"):
            second.acquire()
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        store.fs.pipe_file(first.path, json.dumps(first.me | {"pid": int(gone.stdout), "expires": 4e9}).encode())
        second.me = first.me | {"pid": os.getpid()}
        second.acquire()  # its holder was a process of this host that is gone (a SIGKILL): taken over
        second.release()
        assert not store.fs.exists(first.path)
    finally:
        first._stop.set()


def test_the_mirror_follows_what_the_store_committed(store, tmp_path, capsys):
    """At start the local mirror drops steps the store has not committed, gets the newest committed one (again when
    its cached copy lost a file), and a fresh run on a prefix with checkpoints is refused."""
    from waypoint.run.output_dir import RunDir
    from waypoint.run.store_run import sync_mirror

    store.upload(committed_step(tmp_path / "node", "step_2", {"w": b"2" * 64}))
    store.fs.pipe_file(store.path("step_4/w"), b"half")  # a killed upload
    mirror = tmp_path / "mirror"
    committed_step(mirror, "step_4", {"w": b"4" * 64})  # cached locally, never committed in the store
    run_dir = RunDir(mirror, store.url)
    sync_mirror(run_dir, "auto", False)
    assert sorted(p.name for p in mirror.iterdir() if not p.name.startswith(".")) == ["step_2"]
    assert (mirror / "step_2/w").read_bytes() == b"2" * 64
    assert "skipping s3://" in capsys.readouterr().out
    (mirror / "step_2/w").unlink()  # a cached copy that lost a file is fetched again
    sync_mirror(run_dir, "auto", False)
    assert (mirror / "step_2/w").read_bytes() == b"2" * 64
    with pytest.raises(CheckpointError, match="already holds checkpoints; .* never overwritten"):
        sync_mirror(run_dir, False, False)
    store.delete("step_2")
    with pytest.raises(CheckpointError, match="none is committed and complete; set overwrite=true"):
        sync_mirror(run_dir, "auto", False)


def test_a_step_broken_in_the_store_is_repaired_from_the_verified_mirror(store, tmp_path, capsys):
    """The store is what other machines resume from: a committed step whose objects were truncated or lost there is
    uploaded again from the mirror's copy when that copy verifies (the wrong objects kept aside, the manifest last);
    otherwise one line says it is broken and how to be rid of it. A mirror copy of another step_N is dropped."""
    from waypoint.run.output_dir import RunDir
    from waypoint.run.store_run import sync_mirror

    mirror, weights_data = tmp_path / "mirror", os.urandom(3000)
    store.upload(committed_step(tmp_path / "node", "step_2", {"w": b"2" * 64}))
    store.upload(committed_step(mirror, "step_4", {"model.safetensors": weights_data, "config.json": b"{}"}))
    store.fs.pipe_file(store.path("step_4/model.safetensors"), b"short")
    store.fs.rm_file(store.path("step_4/config.json"))
    run_dir = RunDir(mirror, store.url)
    sync_mirror(run_dir, "auto", False)
    assert capsys.readouterr().out.splitlines() == [
        f"repaired {store.url}/step_4 (config.json is missing): uploaded 2 file(s) from this machine's verified copy, "
        f"manifest last; the broken objects are kept at {store.url}/step_4.broken"]
    assert store.check("step_4").ok and store.fs.cat_file(store.path("step_4/model.safetensors")) == weights_data
    assert store.fs.cat_file(store.path("step_4.broken/model.safetensors")) == b"short"

    store.fs.pipe_file(store.path("step_4/model.safetensors"), b"short again")
    (mirror / "step_4/model.safetensors").write_bytes(bytes([weights_data[0] ^ 1]) + weights_data[1:])
    sync_mirror(run_dir, "auto", False)  # the mirror's copy does not verify either: nothing is uploaded
    assert f"warning: skipping {store.url}/step_4: model.safetensors has 11 bytes, manifest says 3000; the store's copy " \
           f"is broken and was not repaired (rank 0's machine holds no verified copy of it): delete {store.url}/step_4 " \
           "so that no run resumes from it" in capsys.readouterr().out
    assert store.fs.cat_file(store.path("step_4/model.safetensors")) == b"short again"

    committed_step(tmp_path / "other", "step_2", {"w": b"x" * 64})  # a mirror's copy of another step_2: dropped
    shutil.rmtree(mirror / "step_2")
    shutil.move(tmp_path / "other/step_2", mirror / "step_2")
    store.delete("step_4")
    sync_mirror(run_dir, "auto", False)
    assert (mirror / "step_2/w").read_bytes() == b"2" * 64


def test_a_rerun_repairs_its_step_broken_in_the_store_and_S3_in_upper_case_is_the_store(endpoint, tmp_path, monkeypatch, capsys):
    """The issue's case: the run's last step truncated in the store, the mirror intact; the rerun said "nothing to
    do" and left the store broken for every other machine. ``S3://`` is ``s3://``, never a local folder ``S3:``."""
    from waypoint.run.object_store import ObjectStore

    from recipes import full_finetune

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WAYPOINT_CACHE", str(tmp_path / "cache"))
    bucket = new_bucket()
    args = ["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir=S3://{bucket}/run", *BASE[:2], "max_steps_per_epoch=2",
            f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", "verify_export=false"]
    assert full_finetune.main(args) == 0
    assert sorted(os.listdir(tmp_path)) == ["cache"]
    store = ObjectStore(f"s3://{bucket}/run")
    shard = sorted(f for f in store.manifest("step_2")["files"] if f.endswith(".safetensors"))[0]
    store.fs.pipe_file(store.path(f"step_2/{shard}"), b"truncated")
    capsys.readouterr()
    assert full_finetune.main(args) == 0
    out = capsys.readouterr().out
    assert f"repaired s3://{bucket}/run/step_2 ({shard} has 9 bytes, manifest says " in out and "nothing to do" in out
    assert store.check("step_2").ok


def run(out, *overrides, fault=None, cache=None):
    """The full recipe with ``cache`` as this machine's local mirror; in this process unless the fault kills it."""
    if not any(o.startswith("checkpointer.checkpoint_dir=") for o in overrides):
        overrides = (*overrides, f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}")
    return run_recipe("full", ["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={out}", *BASE, *overrides],
                      fault=fault, env={"WAYPOINT_CACHE": str(cache)})


BASE = [f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "epochs=1", "max_steps_per_epoch=8",
        "model.attn_dropout=0.1", "keep_last_n_checkpoints=1", "save_every_n_steps=3"]


def losses(lines):
    return [json.loads(line)["loss"] for line in lines.splitlines() if '"loss"' in line]


@pytest.mark.slow
def test_fine_tune_to_s3_killed_during_an_upload_resumes_bit_exactly(endpoint, tmp_path, monkeypatch):
    from waypoint.run.object_store import ObjectStore

    from recipes import full_finetune

    reference = tmp_path / "local"  # the run that never stopped, in this process (no interpreter start-up)
    assert full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={reference}", *BASE,
                               f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}"]) == 0

    bucket = new_bucket()  # the input comes from the store too: cached on each machine with a size check
    model = ObjectStore(f"s3://{bucket}/models/tiny_llama")
    for f in (ROOT / "assets/tiny_llama").iterdir():
        model.fs.put_file(str(f), model.path(f.name))
    url, source = f"s3://{bucket}/runs/tiny", f"checkpointer.checkpoint_dir={model.url}"
    killed = run(url, source, fault=["kill-in-upload", "6", "-"], cache=tmp_path / "node_a")
    assert killed.returncode == -9, killed.stderr[-2000:]
    store = ObjectStore(url)
    assert store.steps() == ["step_6", "step_3"] and not store.check("step_6").ok  # half uploaded: not a checkpoint
    assert store.check("step_3").ok

    # another machine: no local mirror; it resumes from the newest committed step
    resumed = run(url, source, cache=tmp_path / "node_b")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{model.url}: {len(list((ROOT / 'assets/tiny_llama').iterdir()))} files" in resumed.stdout
    assert "downloaded s3://" in resumed.stdout and "resuming from step_3" in resumed.stdout
    assert "uploaded s3://" in resumed.stdout and "MB/s" in resumed.stdout
    assert store.steps() == ["step_8"] and store.check("step_8").ok
    assert store.fs.exists(store.path("step_6.partial")), "the killed upload's objects were deleted, not set aside"
    assert not store.fs.exists(store.path(".waypoint.lock")), "the lock outlived the run"

    # a step in the store is read by the same code as one on disk
    from scripts import inspect as inspect_script
    monkeypatch.setenv("WAYPOINT_CACHE", str(tmp_path / "inspecting"))
    assert inspect_script.main([f"{url}/step_8"]) == 0

    # the same losses as the run that never stopped, and the same final weights
    assert losses(store.fs.cat_file(store.path("metrics.jsonl")).decode()) == losses((reference / "metrics.jsonl").read_text())
    copy = tmp_path / "final"
    copy.mkdir()
    store.download("step_8", copy / "step_8")
    mine, theirs = weights(copy / "step_8"), weights(reference / "step_8")
    assert mine and mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    shutil.rmtree(copy)


def two_machines(url: str, model: str, caches: list) -> Finished:
    """The full recipe as two machines of one process each (each rank its machine's first: LOCAL_RANK 0), each with
    its own cache: nothing on one machine's disk is seen by the other. Ranks forked as torchrun starts them."""
    from tests.test_distributed import BASE as RUN, GLOBAL_BATCH

    args = ["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={url}", *RUN, f"batch_size={GLOBAL_BATCH // 2}",
            f"checkpointer.checkpoint_dir={model}"]
    machines = [{"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(node), "WAYPOINT_CACHE": str(cache)}
                for node, cache in enumerate(caches)]
    return run_recipe("full", args, processes=len(caches), rank_env=machines, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_torchrun_on_two_machines_without_a_shared_disk_saves_to_s3_and_resumes_bit_exactly(endpoint, tmp_path):
    """Each rank uploads the shards it wrote from its own machine, rank 0 commits the step; a rerun downloads the
    step on every machine whose cache lacks it and continues to the same bytes as the run that never stopped."""
    from waypoint.run.object_store import ObjectStore
    from waypoint.checkpointers.file_formats import read_tensors

    bucket = new_bucket()
    url, model = f"s3://{bucket}/runs/machines", ObjectStore(f"s3://{bucket}/models/tiny_llama")
    for f in (ROOT / "assets/tiny_llama").iterdir():  # the input too: each machine caches its own copy
        model.fs.put_file(str(f), model.path(f.name))
    a, b, c = tmp_path / "machine_a", tmp_path / "machine_b", tmp_path / "machine_c"
    ran = two_machines(url, model.url, [a, b])
    assert ran.returncode == 0, [output[-3000:] for output in ran.ranks]
    store = ObjectStore(url)
    assert store.steps() == ["step_8", "step_6", "step_4", "step_2"]
    assert all(store.check(n).ok for n in store.steps())
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(store.manifest("step_6")["files"])
    assert (b / "inputs").is_dir(), "machine b did not cache the input model"
    leftovers = [p for p in (b / "runs").rglob("*") if p.name.startswith(".step_")]
    assert not leftovers, f"machine b kept staging directories: {leftovers}"

    store.fs.rm_file(store.path("step_8/MANIFEST.json"))  # the last step never committed: rerun from step_6
    ran = two_machines(url, model.url, [a, c])
    assert ran.returncode == 0, [output[-3000:] for output in ran.ranks]
    first, second = ran.ranks
    assert "resuming from step_6" in first and "downloaded s3://" in first  # machine a's copy lacked b's shards
    assert "downloaded s3://" in second  # machine c had nothing
    assert store.check("step_8").ok and store.fs.exists(store.path("step_8.partial"))
    remade = store.manifest("step_8")["files"]
    weights_files = [f for f in remade if f.endswith(".safetensors")]
    assert weights_files
    for f in weights_files:
        mine = tmp_path / "remade.safetensors"
        mine.write_bytes(store.fs.cat_file(store.path(f"step_8/{f}")))
        theirs = tmp_path / "before.safetensors"
        theirs.write_bytes(store.fs.cat_file(store.path(f"step_8.partial/{f}")))
        x, y = read_tensors(mine), read_tensors(theirs)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f


@pytest.mark.slow
def test_dpo_to_s3_preempted_resumes_on_another_machine_from_the_steps_reference(endpoint, tmp_path, monkeypatch):
    """A preference run's reference log-probs travel with its steps: preempted after step 3, it resumes on a machine
    without the first one's mirror (so without its output_dir/reference/), reads the table from step_3 in the
    store, verified with it, and ends bit-identical to a run that never stopped."""
    from recipes import dpo_finetune
    from tests.conftest import sigterm_at_step
    from waypoint.run.object_store import ObjectStore

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((ROOT / "assets/tiny_dpo.jsonl").read_text().splitlines(keepends=True)[:40]))
    dpo = ["--config", str(ROOT / "configs/tiny_dpo.yaml"), f"dataset.source={data}", "epochs=1", "validation=null",
           "save_every_n_steps=2", "keep_last_n_checkpoints=1", "verify_export=false"]
    reference = tmp_path / "local"
    assert dpo_finetune.main([*dpo, f"output_dir={reference}"]) == 0
    url = f"s3://{new_bucket()}/runs/dpo"
    monkeypatch.setenv("WAYPOINT_CACHE", str(tmp_path / "node_a"))
    with sigterm_at_step(3):
        assert dpo_finetune.main([*dpo, f"output_dir={url}"]) == 75
    store = ObjectStore(url)
    assert store.steps() == ["step_3"] and "recipe_state.pt" in store.manifest("step_3")["files"]  # the table is in it
    monkeypatch.setenv("WAYPOINT_CACHE", str(tmp_path / "node_b"))  # another machine: an empty mirror
    assert dpo_finetune.main([*dpo, f"output_dir={url}"]) == 0
    assert store.steps() == ["step_5"] and store.check("step_5").ok
    for name in sorted(p.name for p in (reference / "step_5").glob("model-*.safetensors")):
        assert store.fs.cat_file(store.path(f"step_5/{name}")) == (reference / "step_5" / name).read_bytes(), name


def test_a_vision_language_run_to_s3_preempted_resumes_on_another_machine(endpoint, tmp_path, monkeypatch):
    """The tiny VLM (images in every batch) to the store: preempted after step 3, resumed on a machine with an empty
    mirror, it ends with the files a run that never stopped writes, the frozen tower byte for byte as it came."""
    from recipes import full_finetune
    from scripts.make_tiny_vlm import make
    from tests.conftest import sigterm_at_step
    from waypoint.run.object_store import ObjectStore

    base = make(tmp_path / "base")
    run = ["--config", str(ROOT / "configs/tiny_vlm.yaml"), f"checkpointer.checkpoint_dir={base}", "epochs=1",
           "max_steps_per_epoch=4", "save_every_n_steps=2", "keep_last_n_checkpoints=1", "progress=off",
           f"dataset.source={ROOT / 'assets/tiny_vlm/colours.jsonl'}"]
    assert full_finetune.main([*run, f"output_dir={tmp_path / 'local'}"]) == 0
    url = f"s3://{new_bucket()}/runs/vlm"
    monkeypatch.setenv("WAYPOINT_CACHE", str(tmp_path / "node_a"))
    with sigterm_at_step(3):
        assert full_finetune.main([*run, f"output_dir={url}"]) == 75
    monkeypatch.setenv("WAYPOINT_CACHE", str(tmp_path / "node_b"))
    assert full_finetune.main([*run, f"output_dir={url}"]) == 0
    store = ObjectStore(url)
    assert store.steps() == ["step_4"] and store.check("step_4").ok
    written = store.fs.cat_file(store.path("step_4/model.safetensors"))
    assert written == (tmp_path / "local/step_4/model.safetensors").read_bytes()
