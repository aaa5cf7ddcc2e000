"""The ``waypoint`` command: ``ls`` lists what ships, ``cp`` copies it out without overwriting, ``run`` runs a recipe
by name or a copy of one (under torchrun's own launcher with ``--nproc-per-node``), ``validate`` prints every problem
and writes nothing, the script subcommands are the scripts, bad input is one line; and a built wheel, installed
apart from this checkout, runs ``waypoint run full_finetune --config tiny`` from an empty directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from waypoint.cli import shipped
from waypoint.cli.main import main

SHORT = ["epochs=1", "max_steps_per_epoch=1", "batch_size=2"]


def test_ls_lists_every_recipe_and_every_config_under_the_recipe_its_header_names(capsys):
    assert main(["ls"]) == 0
    printed = capsys.readouterr().out
    listed = {}
    for line in printed.replace(",\n", ", ").splitlines():
        recipe, _, names = line.partition(" ")
        listed[recipe] = [n.strip() for n in names.split(",") if n.strip()]
    assert sorted(listed) == sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
    configs = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert sorted(n for names in listed.values() for n in names) == configs  # each once
    assert "tiny" in listed["full_finetune"] and "tiny_lora" in listed["lora_finetune"] and "tiny_dpo" in listed["dpo_finetune"]
    for recipe, names in listed.items():
        for name in names:
            assert shipped.recipe_of(ROOT / "configs" / f"{name}.yaml") == recipe, name


def test_cp_copies_out_and_never_overwrites(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["cp", "tiny_lora", "mine.yaml"]) == 0 and main(["cp", "full_finetune", "."]) == 0
    assert (tmp_path / "mine.yaml").read_bytes() == (ROOT / "configs/tiny_lora.yaml").read_bytes()
    assert (tmp_path / "full_finetune.py").read_bytes() == (ROOT / "recipes/full_finetune.py").read_bytes()
    (tmp_path / "mine.yaml").write_text("# edited\n")
    assert main(["cp", "tiny", "mine.yaml"]) == 2 and (tmp_path / "mine.yaml").read_text() == "# edited\n"
    assert "error: mine.yaml exists; choose another name (nothing was overwritten)" in capsys.readouterr().err
    assert main(["cp", "tiyn", "x.yaml"]) == 2
    assert "error: 'tiyn' is neither a shipped recipe nor a shipped config" in capsys.readouterr().err


def test_cp_writes_nothing_through_a_dangling_link(tmp_path, capsys, monkeypatch):
    """``link.yaml`` a symbolic link to a file that does not exist (outside the current directory): refused in one
    line, as GNU cp refuses, and nothing is written where it points (it was written there before)."""
    here, outside = tmp_path / "here", tmp_path / "elsewhere" / "target.yaml"
    here.mkdir()
    outside.parent.mkdir()
    (here / "link.yaml").symlink_to(outside)
    monkeypatch.chdir(here)
    assert main(["cp", "tiny", "link.yaml"]) == 2
    assert capsys.readouterr().err == (f"error: link.yaml is a symbolic link to {outside}, which does not exist; cp writes "
                                       "nothing through it: remove the link or choose another name (see waypoint cp --help)\n")
    assert not outside.exists() and list(outside.parent.iterdir()) == []
    (here / "linked").mkdir()
    (here / "linked" / "tiny.yaml").symlink_to(outside)  # the same, as the file a folder given gets
    assert main(["cp", "tiny", "linked"]) == 2 and not outside.exists()


def test_cp_into_a_folder_it_cannot_write_is_one_line(tmp_path, capsys, monkeypatch):
    """A destination the user may not write (the tests run as root, so the denial is the OS's answer made up) is one
    line naming it, exit 1, and no file is left behind; a write failing half way (a full disk) removes its file."""
    import errno

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ro").mkdir()
    import builtins

    def denying(real):  # the OS's answer for a file opened in ro/, by either way of opening one
        def opened(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path).parent.name == "ro":
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real(path, *args, **kwargs)
        return opened
    with monkeypatch.context() as patched:
        patched.setattr(os, "open", denying(os.open))
        patched.setattr(builtins, "open", denying(builtins.open))
        assert main(["cp", "tiny", "ro/x.yaml"]) == 1
    assert capsys.readouterr().err == ("error: ro/x.yaml: cannot write it (Permission denied); choose a folder you can "
                                       "write (nothing was written)\n")

    import shutil

    def full(source, dest, *args):
        dest.write(source.read(100))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(shutil, "copyfileobj", full)
    assert main(["cp", "tiny", "x.yaml"]) == 1
    assert capsys.readouterr().err == ("error: x.yaml: cannot write it (No space left on device); choose a folder you can "
                                       "write (nothing was written)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"] and list((tmp_path / "ro").iterdir()) == []


def test_a_copied_config_finds_the_shipped_groups_and_runs(tmp_path, monkeypatch, capsys):
    """``waypoint cp tiny_lora my_lora.yaml`` then running it: its ``checkpointer: hf`` default (and +metric_logger)
    come from the shipped config groups, which are not beside the copy."""
    monkeypatch.chdir(tmp_path)
    assert main(["cp", "tiny_lora", "my_lora.yaml"]) == 0
    assert main(["validate", "my_lora.yaml", "+metric_logger=mlflow"]) == 0, capsys.readouterr().err
    assert main(["run", "lora_finetune", "--config", "my_lora.yaml", "epochs=1", "max_steps_per_epoch=2",
                 "output_dir=outputs/my_lora"]) == 0, capsys.readouterr().err
    assert (tmp_path / "outputs/my_lora/step_2/adapter_model.safetensors").is_file()


def test_run_a_copied_recipe_by_its_path_on_a_shipped_config_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no assets/ here: the config's assets/... are the shipped ones
    assert main(["cp", "full_finetune", "my_recipe.py"]) == 0
    assert main(["run", "my_recipe.py", "--config", "tiny", "output_dir=out", *SHORT]) == 0
    assert (tmp_path / "out/step_1/model.safetensors.index.json").is_file()
    record = json.loads((tmp_path / "out/metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1
    assert main(["run", "full_finetune", "--config", "tny"]) == 2
    assert "error: --config config 'tny': no such file, nor a shipped config (did you mean tiny" in capsys.readouterr().err
    assert main(["run", "full_finetun", "--config", "tiny"]) == 2
    assert "error: recipe 'full_finetun': not a shipped recipe (dpo_finetune, " in capsys.readouterr().err


def test_validate_prints_every_problem_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "tiny_lora", "lora.rank=0", "lr_scheduler.num_warmup_steps=-1",
                 "dataset.source=missing.jsonl", "output_dir=out", "+optimizer.betas2=[0.9,0.95]"]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["error: lr_scheduler.num_warmup_steps=-1: expected an integer >= 0",
                       "error: lora.rank=0: expected an integer >= 1",
                       "error: optimizer.betas2: AdamW has no option 'betas2' (did you mean betas?)",
                       "error: dataset.source=missing.jsonl: no such file or folder"], printed
    assert main(["validate", "tiny_dpo", "output_dir=out"]) == 0
    assert capsys.readouterr().out.strip().endswith("tiny_dpo.yaml: ok for dpo_finetune")
    assert main(["validate", "tiny", "epoch=2"]) == 1
    assert capsys.readouterr().out.strip() == "error: unknown option epoch (did you mean epochs?); to add a new key, write +epoch=..."
    assert list(tmp_path.iterdir()) == []  # nothing written, no checkpoint read


@pytest.mark.parametrize("overrides,expected", [
    (["loss.beta=inf"], "error: loss.beta=inf: expected a finite number > 0"),
    (["loss.beta=nan"], "error: loss.beta=nan: expected a finite number > 0"),
    (["loss.type=simpo", "loss.gamma=inf"], "error: loss.gamma=inf: expected a finite number >= 0"),
    (["loss.type=hinge", "loss.label_smoothing=0.1"],
     "error: loss.label_smoothing applies to the sigmoid and simpo losses, not hinge; set loss.label_smoothing=0"),
])
def test_validate_refuses_a_preference_loss_that_could_only_end_in_nan(overrides, expected, tmp_path, monkeypatch,
                                                                        capsys):
    """These once passed `waypoint validate` (and the recipe's checks): the run computed the reference pass, wrote
    reference/, then stopped at step 1 with a nan loss."""
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "tiny_dpo", *overrides, "output_dir=out"]) == 1
    assert capsys.readouterr().out.strip() == expected
    assert list(tmp_path.iterdir()) == []


def test_script_subcommands_are_the_scripts(capsys):
    assert main(["inspect", str(ROOT / "assets/tiny_llama")]) == 0
    assert "hf checkpoint, model type LLAMA2" in capsys.readouterr().out
    for command in ("convert", "download", "inspect", "merge-lora", "plot", "generate", "validate", "run", "cp", "ls"):
        assert main([command, "--help"]) == 0, command
        printed = capsys.readouterr().out
        assert printed.startswith(f"usage: waypoint {'plot-metrics' if command == 'plot' else command}") and "xample" in printed \
            or "e.g. " in printed, (command, printed)
    assert main(["convrt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown command 'convrt': one of ls, cp, run, validate, generate, convert, ") and err.count("\n") == 1


def test_run_with_nproc_per_node_hands_the_command_line_to_torchrun(monkeypatch, capsys):
    """torchrun's own launcher gets the recipe's file and the arguments as given (real torchrun runs of the recipes:
    tests/test_distributed.py); a failed rank is one line and exit 1."""
    import torch.distributed.run

    launched = []
    monkeypatch.setattr(torch.distributed.run, "main", launched.append)
    assert main(["run", "--nproc-per-node", "2", "full_finetune", "--config", "tiny", "device=cpu"]) == 0
    assert launched == [["--nproc-per-node=2", str(ROOT / "recipes/full_finetune.py"), "--config", "tiny", "device=cpu"]]

    def fails(argv):
        raise RuntimeError("ChildFailedError")
    monkeypatch.setattr(torch.distributed.run, "main", fails)
    assert main(["run", "--nproc-per-node", "2", "full_finetune", "--config", "tiny"]) == 1
    assert capsys.readouterr().err.strip() == "error: RuntimeError: a process of the run failed (its error is above)"
    assert main(["run", "--nproc-per-node", "0", "full_finetune", "--config", "tiny"]) == 2
    assert "error: --nproc-per-node 0: expected a positive number" in capsys.readouterr().err


def test_a_built_wheel_runs_from_an_empty_directory(tmp_path):
    """``pip wheel .`` then the wheel installed into its own folder (not this checkout's editable install), and
    ``waypoint run full_finetune --config tiny`` in an empty directory: the recipes, configs and assets came along."""
    wheels, target, empty = tmp_path / "wheels", tmp_path / "installed", tmp_path / "empty"
    empty.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run([*pip, "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("waypoint-*.whl")
    installed = subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import waypoint; print(waypoint.__file__)"], cwd=empty, env=env,
                           capture_output=True, text=True, timeout=120)
    assert Path(where.stdout.strip()).is_relative_to(target), where.stdout + where.stderr
    run = subprocess.run([str(target / "bin" / "waypoint"), "run", "full_finetune", "--config", "tiny", "output_dir=out",
                          *SHORT], cwd=empty, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (empty / "out/step_1/model.safetensors.index.json").is_file() and "done: the final model is out/step_1" in run.stdout
