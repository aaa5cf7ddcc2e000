"""scripts/gpu_smoke.py, the GPU check of every recipe: its cases cover every recipe, it refuses a CUDA run where
there is no GPU in one line, and a case runs (here on the CPU) to its final save with one line of result."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts/gpu_smoke.py"


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def load_gpu_smoke():
    """The script as a module, this process's sys.path as it was (the script drops its own folder from it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    gpu_smoke = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.modules["gpu_smoke"] = gpu_smoke  # dataclasses look their module up
    try:
        spec.loader.exec_module(gpu_smoke)
    finally:
        sys.path[:] = saved
        del sys.modules["gpu_smoke"]
    return gpu_smoke


def test_the_cases_cover_every_recipe_and_the_families_that_crashed():
    gpu_smoke = load_gpu_smoke()
    used = {a for case in gpu_smoke.CASES for a in case.argv if a.startswith("recipes/")}
    assert used == {f"recipes/{p.name}" for p in (ROOT / "recipes").glob("*.py")}
    names = {case.name for case in gpu_smoke.CASES}
    assert {"lora", "qlora-nf4", "dpo-lora", "gpt-oss-mxfp4-lora-experts", "torchrun-full", "torchrun-lora",
            "qwen3-moe-full", "deepseek-v3-full-bf16", "qwen3-fp8-lora"} <= names
    assert all("device={device}" in case.argv for case in gpu_smoke.CASES)
    listed = run("--list")  # as a script: what a user types
    assert listed.returncode == 0 and listed.stdout.split() == [case.name for case in gpu_smoke.CASES]


def test_cuda_without_a_gpu_and_an_unknown_case_are_one_line(tmp_path, capsys):
    """In this process (the script's main): a fresh Python for each would import torch again."""
    import torch

    gpu_smoke = load_gpu_smoke()
    if not torch.cuda.is_available():
        assert gpu_smoke.main(["--device", "cuda", "--workdir", str(tmp_path / "w")]) == 2
        err = capsys.readouterr().err
        assert err.strip().count("\n") == 0 and "sees no CUDA device; --device cpu runs the cases on the CPU" in err
    assert gpu_smoke.main(["--only", "lora,nope"]) == 2
    assert capsys.readouterr().err.strip() == "error: --only nope: no such case; --list shows them"


def test_a_case_runs_to_its_final_save_and_says_so_in_one_line(tmp_path, capsys):
    """The script's main in this process; the case itself runs as the user's command, in a process of its own."""
    assert load_gpu_smoke().main(["--device", "cpu", "--only", "lora", "--workdir", str(tmp_path / "w")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[1:-1]] == [["PASS", "lora"]]
    assert lines[-1].startswith("1 passed, 0 failed, 0 skipped")
    assert (tmp_path / "w/lora/step_3/merged/config.json").is_file()
    assert "export verified" in (tmp_path / "w/logs/lora.log").read_text()
