"""Bad input to recipes/eval.py: every case one ``error:`` line naming the option, file or task and what to do, exit
status 1, no traceback, nothing written. A new check of eval.py gets its row in CASES."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import LM_EVAL, ROOT
from tests.test_generate_bad_input import ADAPTER_PATH, OTHER_BASE, committed_step, damaged_adapter, other_base_adapter

pytestmark = LM_EVAL

TINY = ROOT / "assets/tiny_llama"
TASKS = ROOT / "assets/eval_tasks"


def existing(tmp: Path, name: str) -> Path:
    (tmp / name).write_text("{}")
    return tmp / name


def broken_yaml(tmp: Path) -> Path:
    """A task file with a YAML syntax error on its line 3."""
    (tmp / "broken.yaml").write_text("task: broken\ndataset_path: x\n  bad: [1, 2\noutput_type: multiple_choice\n")
    return tmp / "broken.yaml"


def tasks_with_a_bad_line(tmp: Path) -> Path:
    """The shipped task folder, copied, with a comma gone from line 3 of tiny_choice.jsonl."""
    folder = tmp / "tasks"
    shutil.copytree(TASKS, folder, ignore=shutil.ignore_patterns("__pycache__"))
    lines = (folder / "tiny_choice.jsonl").read_text().splitlines(keepends=True)
    lines[2] = lines[2].replace('?", "choices"', '?" "choices"', 1)
    (folder / "tiny_choice.jsonl").write_text("".join(lines))
    return folder


# (case id, the overrides (a function of a fresh tmp_path), the one error line expected (a regex))
CASES = [
    ("checkpoint_dir_missing", lambda t: [f"checkpoint_dir={t / 'nope'}"], r"nope: not a recognised checkpoint directory"),
    ("checkpoint_dir_a_number", lambda t: ["checkpoint_dir=7"], r"checkpoint_dir=7: expected a non-empty string"),
    ("checkpoint_dir_fails_its_manifest", lambda t: [f"checkpoint_dir={committed_step(t)}"],
     r"checkpoint_dir=.*/step_1: fails its MANIFEST\.json \(model-00002-of-00003\.safetensors does not match its hash\)"),
    ("adapter_dir_missing", lambda t: [f"adapter_dir={t / 'nope'}"], r"nope/adapter_config\.json: missing"),
    ("adapter_dir_fails_its_manifest", lambda t: [f"adapter_dir={damaged_adapter(t)}"],
     r"adapter_dir=.*/adapter: fails its MANIFEST\.json \(adapter_model\.safetensors does not match its hash\)"),
    ("adapter_dir_of_another_base", lambda t: [f"adapter_dir={other_base_adapter(t)}"],
     rf"{ADAPTER_PATH} has shape \[(4, 64|64, 4)\], but the base's .*; {OTHER_BASE}"),
    ("tasks_unknown", lambda t: ["tasks=[tiny_choise]"],
     r"tasks: unknown task 'tiny_choise' \(did you mean tiny_choice.*\): not one of lm-eval's tasks nor in include_path "
     r"\(.*eval_tasks\); `lm-eval ls tasks` lists them, or give a task's YAML file$"),
    ("tasks_file_missing", lambda t: [f"tasks=[{t / 'nope.yaml'}]"], r"tasks: .*/nope\.yaml: no such task file$"),
    ("tasks_file_not_yaml", lambda t: [f"tasks=[{broken_yaml(t)}]"],
     r"tasks: .*/broken\.yaml, line 3, column 6: not valid YAML \(mapping values are not allowed here\); fix the task file$"),
    ("task_data_line_not_json", lambda t: ["tasks=[tiny_choice]", f"include_path=[{tasks_with_a_bad_line(t)}]"],
     r".*/tasks/tiny_choice\.jsonl, line 3: not valid JSON \(Expecting ',' delimiter, column \d+\); fix that line$"),
    ("tasks_empty", lambda t: ["tasks=[]"], r"tasks=\[\]: expected a non-empty list of task names or task YAML files"),
    ("include_path_missing", lambda t: [f"include_path=[{t / 'nope'}]"],
     r"include_path=.*/nope: no such directory \(a folder of lm-eval task YAML files\)$"),
    ("include_path_a_number", lambda t: ["include_path=3"], r"include_path=3: expected null, a folder of task YAML files"),
    ("num_fewshot_negative", lambda t: ["num_fewshot=-1"], r"num_fewshot=-1: expected null or an integer >= 0$"),
    ("limit_zero", lambda t: ["limit=0"], r"limit=0: expected null, an integer >= 1 \(documents per task\) or a fraction"),
    ("batch_size_zero", lambda t: ["batch_size=0"], r"batch_size=0: expected an integer >= 1$"),
    ("max_length_past_the_positions", lambda t: ["max_length=1024"],
     r"max_length=1024: expected 2 \.\. 512 \(the model's positions\)$"),
    ("max_length_below_a_tasks_max_gen_toks", lambda t: ["max_length=16", "tasks=[tiny_generate]"],
     r"max_length=16: no room for a prompt before the 24 new tokens a task asks for \(its max_gen_toks\); raise max_length$"),
    ("max_gen_toks_zero", lambda t: ["max_gen_toks=0"], r"max_gen_toks=0: expected an integer >= 1$"),
    ("add_bos_token_not_a_boolean", lambda t: ["add_bos_token=maybe"], r"add_bos_token=maybe: expected null or true or false$"),
    ("bootstrap_iters_negative", lambda t: ["bootstrap_iters=-1"], r"bootstrap_iters=-1: expected an integer >= 0$"),
    ("output_exists", lambda t: [f"output={existing(t, 'mine.json')}"],
     r"output=.*/mine\.json: already exists \(results are never written over a file\); choose another path"),
    ("output_not_json", lambda t: [f"output={t / 'results.txt'}"],
     r"output=.*/results\.txt: expected null or the path of a new \.json file$"),
    ("seed_negative", lambda t: ["seed=-1"], r"seed=-1: expected an integer >= 0$"),
    ("device_unknown", lambda t: ["device=gpu"], r"device=gpu: expected cpu, cuda or cuda:N$"),
    ("dtype_unknown", lambda t: ["dtype=fp12"], r"dtype=fp12: expected one of float32, "),
    ("option_unknown", lambda t: ["task=[tiny_choice]"], r"unknown option task \(did you mean tasks\?\); to add a new key"),
]


def run_eval(capsys, *overrides: str) -> tuple[int, str, str]:
    from recipes import eval as recipe

    capsys.readouterr()
    try:
        code = recipe.main(["--config", str(ROOT / "configs/eval.yaml"), f"include_path=[{TASKS}]", "limit=2",
                            "bootstrap_iters=0", *overrides])
    except SystemExit as stop:  # a bad option: parse_config exits
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code: int, err: str) -> str:
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


@pytest.mark.parametrize("make_overrides,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_to_eval_is_one_line(make_overrides, expected, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)  # results written by mistake would land here
    before = sorted(p.name for p in TINY.iterdir())
    code, out, err = run_eval(capsys, f"checkpoint_dir={TINY}", *make_overrides(tmp_path))
    line = one_error_line(code, err)
    assert re.search(rf"^error: (\S*/)?{expected}", line), line
    assert "results:" not in err and not list(tmp_path.rglob("eval_results*.json"))
    assert sorted(p.name for p in TINY.iterdir()) == before


def test_lm_eval_not_installed_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` fails as where it is not installed
    code, _, err = run_eval(capsys, f"checkpoint_dir={TINY}", f"output={tmp_path / 'r.json'}")
    line = one_error_line(code, err)
    assert line == "error: lm-evaluation-harness (lm_eval) is not installed (lm_eval): pip install 'waypoint[eval]'", line


def test_help_names_the_eval_config(capsys):
    from recipes import eval as recipe

    with pytest.raises(SystemExit) as shown:
        recipe.main(["--help"])
    assert shown.value.code == 0 and "e.g. configs/eval.yaml" in " ".join(capsys.readouterr().out.split())
