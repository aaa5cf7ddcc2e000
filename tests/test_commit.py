"""Atomic checkpoint directories, their manifest, and the streaming safetensors writer."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save

from waypoint.checkpointers.commit import MANIFEST, StagedDir, new_hasher, verify
from waypoint.run.step_dirs import prune_checkpoints, remove_stale_staging, step_dirs
from waypoint.checkpointers.file_formats import write_safetensors
from waypoint.converters import CheckpointError


def test_streaming_writer_is_byte_identical_to_safetensors():
    tensors = {"b.w": torch.randn(3, 4).bfloat16(), "a": torch.randn(5), "c": torch.arange(3), "empty": torch.zeros(0, 2),
               "h": torch.randn(2, 2).half(), "mask": torch.ones(2, dtype=torch.bool), "transposed": torch.randn(4, 3).t()}
    buf = io.BytesIO()
    write_safetensors(buf, tensors, {"format": "pt"})
    assert buf.getvalue() == save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})


def test_staged_dir_commits_with_a_manifest_that_verifies(tmp_path):
    target = tmp_path / "step_3"
    with StagedDir(target) as stage:
        stage.write_bytes("a.json", b"{}")
        stage.write("t.safetensors", lambda f: write_safetensors(f, {"x": torch.arange(10.0)}))
        assert not target.exists(), "nothing is visible before the commit"
    manifest = json.loads((target / MANIFEST).read_text())
    assert set(manifest["files"]) == {"a.json", "t.safetensors"}
    data = (target / "t.safetensors").read_bytes()
    digest = new_hasher(manifest["hash"])
    digest.update(data)
    assert manifest["files"]["t.safetensors"] == {"size": len(data), manifest["hash"]: digest.hexdigest()}
    assert torch.equal(load_file(target / "t.safetensors")["x"], torch.arange(10.0))
    checked = verify(target)
    assert checked.ok and checked.files == 2 and checked.bytes == len(data) + 2
    with pytest.raises(CheckpointError, match="already exists"):
        with StagedDir(target):
            pass


def test_staged_dir_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with StagedDir(tmp_path / "step_1") as stage:
            stage.write_bytes("a", b"x")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_hash_covers_buffers_reused_after_write(tmp_path):
    """torch.save reuses its buffers: what is hashed must be what was written, not what the buffer holds later."""
    def produce(f):
        buf = bytearray(b"a" * 1000)
        f.write(buf)
        buf[:] = b"b" * 1000
        f.write(buf)

    with StagedDir(tmp_path / "step_1") as stage:
        stage.write("f", produce)
    assert verify(tmp_path / "step_1").ok


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "extra-byte"])
def test_verify_finds_damage(tmp_path, damage):
    with StagedDir(tmp_path / "step_1") as stage:
        stage.write_bytes("w", bytes(range(256)) * 100)
    path = tmp_path / "step_1" / "w"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[:-1])
    elif damage == "flip":
        data[1234] ^= 0x80
        path.write_bytes(bytes(data))
    elif damage == "extra-byte":
        path.write_bytes(bytes(data) + b"\0")
    else:
        (tmp_path / "step_1" / MANIFEST).unlink()
    assert not verify(tmp_path / "step_1").ok


def test_step_dirs_sort_numerically_and_prune_keeps_newest(tmp_path):
    for n in (2, 10, 9):
        with StagedDir(tmp_path / f"step_{n}") as stage:
            stage.write_bytes("x", b"1")
    (tmp_path / "step_11").mkdir()  # not committed: never counted, never deleted
    assert [p.name for p in step_dirs(tmp_path)] == ["step_11", "step_10", "step_9", "step_2"]
    prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in step_dirs(tmp_path)) == ["step_10", "step_11", "step_9"]


def test_remove_stale_staging_only_for_dead_processes(tmp_path):
    dead, alive = tmp_path / ".step_3.tmp-999999999", tmp_path / f".step_4.tmp-{os.getppid()}"
    dead.mkdir()
    alive.mkdir()
    remove_stale_staging(tmp_path)
    assert not dead.exists() and alive.exists()


def test_small_and_large_writes_reach_the_file_and_the_hash_in_order(tmp_path):
    """HashingFile gathers small writes (torch.save writes thousands) before handing them on: what reaches the file and
    the manifest's hash is every write in order, a caller's buffer reused after a small write included."""
    import os as _os

    from waypoint.checkpointers.commit import GATHER, SMALL, StagedDir, verify

    pieces, reused = [], bytearray(b"x" * 100)

    def produce(f):
        for i in range(6000):
            size = (i * 37) % 600 if i % 500 else SMALL + i  # mostly small, a large one now and then
            data = _os.urandom(size)
            pieces.append(data)
            (f.write_stable if i % 3 == 0 else f.write)(data)
            if i % 7 == 0:  # a buffer the caller rewrites right after the call, as torch.save does
                reused[:] = _os.urandom(100)
                pieces.append(bytes(reused))
                f.write(memoryview(reused))
                reused[:] = b"\0" * 100
    with StagedDir(tmp_path / "step_1") as stage:
        stage.write("blob.bin", produce)
    written = (tmp_path / "step_1/blob.bin").read_bytes()
    assert len(written) > GATHER  # handed on by size too, not only at the end
    assert written == b"".join(pieces)
    assert verify(tmp_path / "step_1").ok
