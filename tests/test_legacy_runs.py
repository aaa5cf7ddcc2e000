"""Checkpoints written before the ``run/`` redesign still resume, bit-exactly.

tests/legacy_runs/ holds, for four kinds of run (one process; LoRA; torchrun on 2 CPU processes with DCP-sharded
steps; an ``s3://`` output_dir), the step_4 checkpoint that waypoint commit 50ee614 wrote in the middle of a
6-step run, with the run's command, the sha256 of the final step's weight files and every step's loss, grad_norm
and lr (``expected.json``; tests/legacy_runs/make_fixtures.py wrote all of it). Each test lays the checkpoint out
as it was written (``input/``, ``data.jsonl``, ``out/step_4/`` or the bucket's ``run/step_4/``), reruns the same
command, and asserts that the run resumed from step_4 and finished exactly as the uninterrupted run did.

The runs are subprocesses with the environment the fixtures were computed in (``expected.json``'s ``env``: ATen's
AVX2 kernels, MKL's ``AVX2,STRICT`` reproducibility mode, one thread), not ``main`` in this process: float results
depend on the instruction set the kernels use, which in a running process is fixed already (on an AVX512 machine
the final weights differ in their last bits from the AVX2 ones). Pinned, they were the same on the Intel CPUs this
project ran on, but not on an AMD EPYC (2026-11-25: the weights' last bits and a grad norm's 7th digit differ, for
a run from scratch as much as for a resume). So each session first asks whether this CPU computes the fixtures'
numbers (``reproduces_fixtures``: the full run from scratch gives its step_4 byte for byte): where it does, a
resumed run must finish byte for byte as written; where it does not, its steps, learning rates, losses and grad
norms must be the fixture's within 1e-6 (a resume that lost the optimizer's state, the data position or the RNG
is off by far more), and a bitwise resume is what tests/test_resume.py checks on this CPU.

Only the recipes and the test helpers are used here, never ``waypoint.*``: its import paths change.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

FIXTURES = ROOT / "tests/legacy_runs"
TIMEOUT_S = 300


def x86_with_avx2() -> bool:
    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


# one worker runs them all (`--dist loadgroup`): the calibration run (reproduces_fixtures) once, not once a worker
pytestmark = [pytest.mark.skipif(not x86_with_avx2(), reason="the fixtures' numbers are those of x86-64 CPUs with AVX2 "
                                                             "(ATen's AVX2 kernels, MKL's AVX2,STRICT mode)"),
              pytest.mark.xdist_group("legacy")]


def expected(kind: str) -> dict:
    return json.loads((FIXTURES / kind / "expected.json").read_text())


def lay_out(kind: str, workdir: Path, spec: dict, local_step: bool = True) -> Path:
    """``workdir`` as the run had it: the input, the data and (local kinds) ``out/step_4``."""
    workdir.mkdir(parents=True)
    shutil.copytree(FIXTURES / "input", workdir / "input")
    shutil.copyfile(FIXTURES / "data.jsonl", workdir / "data.jsonl")
    if local_step:
        shutil.copytree(FIXTURES / kind / spec["fixture_step"], workdir / "out" / spec["fixture_step"])
    return workdir


def rerun(spec: dict, workdir: Path, cache: Path, output_dir: str | None = None) -> subprocess.CompletedProcess:
    """The command that wrote the fixture, again, in ``workdir``."""
    cmd = [sys.executable, *(spec["launcher"] or []), str(ROOT / "recipes" / f"{spec['recipe']}.py"),
           "--config", str(ROOT / spec["config"]), *(a.format(output_dir=output_dir) for a in spec["args"])]
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=TIMEOUT_S, start_new_session=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "WAYPOINT_CACHE": str(cache), **spec["env"]})


def assert_finished_as_written(spec: dict, result: subprocess.CompletedProcess, files: dict[str, bytes],
                               metrics_text: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"resuming from {spec['fixture_step']} " in result.stdout, output[-4000:]
    written_with = f"(the fixture was computed with {spec['written_with']}; this is torch {_torch_version()})"
    records = [json.loads(line) for line in metrics_text.splitlines() if line.strip()]
    mine = [{k: r[k] for k in ("step", "loss", "grad_norm", "lr")} for r in records if "loss" in r]
    fixture_step = int(spec["fixture_step"].removeprefix("step_"))
    theirs = [m for m in spec["metrics"] if m["step"] > fixture_step]
    assert [m["step"] for m in mine] == [m["step"] for m in theirs], "the resumed run logged other steps"
    assert sorted(files) == sorted(spec["weights_sha256"]), "the final step has other weight files"
    if not reproduces_fixtures():  # this CPU's kernels round otherwise (module docstring)
        for m, t in zip(mine, theirs):
            assert m["lr"] == t["lr"] and all(abs(m[k] - t[k]) <= 1e-6 * abs(t[k]) for k in ("loss", "grad_norm")), \
                f"step {m['step']}: {m} is not the fixture's {t} within 1e-6 {written_with}"
        return
    hashes = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    assert hashes == spec["weights_sha256"], f"the final step's weight files differ from the run that wrote the fixture {written_with}"
    assert mine == theirs, f"losses, grad norms or learning rates differ from the run that wrote the fixture {written_with}"


@functools.cache
def reproduces_fixtures() -> bool:
    """Whether this CPU computes the fixtures' numbers in their environment: the full run from scratch gives the
    fixture's step_4 weights byte for byte."""
    spec = expected("full")
    with tempfile.TemporaryDirectory(prefix="legacy_calibration_") as tmp:
        workdir = lay_out("full", Path(tmp) / "run", spec, local_step=False)
        result = rerun(spec, workdir, Path(tmp) / "cache")
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        step = spec["fixture_step"]
        names = [n for n in spec["weights_sha256"] if n.endswith(".safetensors")]
        return all((workdir / "out" / step / n).read_bytes() == (FIXTURES / "full" / step / n).read_bytes() for n in names)


def _torch_version() -> str:
    import torch

    return torch.__version__


def local_files(step: Path, names) -> dict[str, bytes]:
    return {name: (step / name).read_bytes() for name in names if (step / name).is_file()}


def read_text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("kind", ["full", "lora", "torchrun"])
def test_legacy_checkpoint_resumes_bit_exactly(kind, tmp_path):
    spec = expected(kind)
    workdir = lay_out(kind, tmp_path / "run", spec)
    if kind == "torchrun":
        assert (workdir / "out" / spec["fixture_step"] / "sharded").is_dir(), "torchrun's fixture is DCP-sharded"
    result = rerun(spec, workdir, tmp_path / "cache")
    out = workdir / "out"
    assert_finished_as_written(spec, result, local_files(out / spec["final_step"], spec["weights_sha256"]),
                               read_text(out / "metrics.jsonl"))


@pytest.fixture(scope="module")
def endpoint():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.s3_server import s3_server

    with s3_server() as url:
        yield url


def test_legacy_s3_checkpoint_resumes_bit_exactly(endpoint, tmp_path):
    """The step's objects as the store held them, in a fresh bucket; this machine has no local mirror of the run."""
    import boto3

    from tests.s3_server import new_bucket

    spec = expected("s3")
    workdir = lay_out("s3", tmp_path / "run", spec, local_step=False)
    bucket = new_bucket()
    client = boto3.client("s3", endpoint_url=endpoint)
    step = FIXTURES / "s3" / spec["fixture_step"]
    for path in sorted(p for p in step.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"run/{spec['fixture_step']}/{path.relative_to(step).as_posix()}")
    result = rerun(spec, workdir, tmp_path / "cache", output_dir=f"s3://{bucket}/run")
    assert "downloaded s3://" in result.stdout, (result.stdout + result.stderr)[-4000:]

    def read(key: str) -> bytes | None:
        try:
            return client.get_object(Bucket=bucket, Key=f"run/{key}")["Body"].read()
        except client.exceptions.NoSuchKey:
            return None
    final = {name: read(f"{spec['final_step']}/{name}") for name in spec["weights_sha256"]}
    assert_finished_as_written(spec, result, {k: v for k, v in final.items() if v is not None},
                               (read("metrics.jsonl") or b"").decode())
    assert not (workdir / "out").exists()
