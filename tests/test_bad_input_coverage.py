"""Keep it true: no command, recipe option or script option ships without its bad-input cases.

Each user-facing command (``recipes/*.py``, ``scripts/*.py`` but the developers' tools; ``benchmarks/`` apart) names the
tables of bad inputs that hold it to "one ``error:`` line naming the file, key or option"; every option of the
recipes' option tables has a row of its own (the row's id or override starts with the option), and every script
option that takes a value has a row passing it, or names the test that gives it one. A new script or option fails
here until its cases are written.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import pytest

from tests import (test_bad_input, test_chat_bad_input, test_config_errors, test_dpo_bad_input, test_eval_bad_input,
                   test_generate_bad_input, test_grpo_bad_input, test_script_bad_input)
from tests.conftest import ROOT
from waypoint.cli.grpo_option_checks import GRPO
from waypoint.cli.option_checks import COMMON, EVAL, GENERATE, LORA, PREFERENCE

DEVELOPER_TOOLS = {
    "check_readme": "runs the README's examples for CI",
    "gpu_smoke": "runs every recipe on a GPU for a developer (tests/test_gpu_smoke.py: its bad input)",
    "make_tiny_assets": "builds the checkout's own test assets",
    "make_tiny_dpo": "builds the checkout's own preference pairs (assets/tiny_dpo.jsonl)",
    "trace_modules": "a developer's look at a model's module tree",
}

# command -> the tables of bad input it is held to (for the scripts: the rows of test_script_bad_input.CASES named so)
COMMANDS = {
    "full_finetune": [test_config_errors.CASES, test_chat_bad_input.CASES, test_bad_input.CASES],
    "lora_finetune": [test_config_errors.LORA_CASES],
    "dpo_finetune": [test_dpo_bad_input.CASES],
    "grpo_finetune": [test_grpo_bad_input.CASES],
    "generate": [test_generate_bad_input.CASES],
    "eval": [test_eval_bad_input.CASES],
    **{name: None for name in test_script_bad_input.SCRIPTS},
}

# (script, option) -> the test that passes the option a bad value (where it needs the loopback hub)
TESTED_ELSEWHERE = {
    ("download", "--revision"): "test_hub.py::test_gated_missing_repository_revision_and_file_errors_are_one_line",
    ("download", "--hf-token"): "test_hub.py::test_cli_token_is_used_and_never_printed_or_recorded",
    ("download", "--allow-patterns"): "test_hub.py::test_patterns_that_match_no_file_are_one_line",
    ("download", "--ignore-patterns"): "test_hub.py::test_patterns_that_match_no_file_are_one_line",
}


class NoSetup:
    """Stands in for test_script_bad_input's Setup: a row's argv without building what it points at."""

    tmp = Path("/nonexistent")

    def __getattr__(self, name):
        return lambda *args: f"<{name}>"


def script_rows(script: str) -> list[list[str]]:
    rows = [setup(NoSetup()) for _, setup, _ in test_script_bad_input.CASES]
    return [argv[1:] for argv in rows if argv[0] == script]


def commands_on_disk() -> set[str]:
    files = [*(ROOT / "recipes").glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    return {f.stem for f in files if f.stem != "__init__"} - set(DEVELOPER_TOOLS)


def test_every_command_has_a_table_of_bad_input():
    assert commands_on_disk() == set(COMMANDS), "a command without bad-input cases: add it to COMMANDS with its table"
    for command, tables in COMMANDS.items():
        if tables is None:
            assert script_rows(command), f"{command}: no row in tests/test_script_bad_input.py's CASES"
        else:
            assert all(len(table) >= 5 for table in tables), command


def option_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def rows_of(cases):
    def rows(tmp: Path) -> list[tuple[str, list[str]]]:
        """Each row's overrides, built in a folder of its own (as its test would)."""
        folders = [tmp / str(i) for i in range(len(cases))]
        for folder in folders:
            folder.mkdir()
        return [(case_id, make(folder)) for (case_id, make, _), folder in zip(cases, folders)]
    return rows


generate_rows = rows_of(test_generate_bad_input.CASES)


@pytest.mark.parametrize("options,rows", [
    (COMMON, lambda tmp: [(option_of(o), [o]) for o, _ in test_config_errors.CASES]),
    (LORA, lambda tmp: [(option_of(o), [o]) for o, _ in test_config_errors.LORA_CASES]),
    (GENERATE, generate_rows),
    (EVAL, rows_of(test_eval_bad_input.CASES)),
    (PREFERENCE, lambda tmp: [(case_id, test_dpo_bad_input.overrides_of(case_id, tmp, tmp / "d.jsonl"))
                              for case_id, _ in test_dpo_bad_input.CASES]),
    (GRPO, lambda tmp: [(case_id, test_grpo_bad_input.overrides_of(case_id, tmp, tmp / "d.jsonl"))
                        for case_id, _ in test_grpo_bad_input.CASES]),
], ids=["common", "lora", "generate", "eval", "preference", "grpo"])
def test_every_recipe_option_has_a_bad_value_row(options, rows, tmp_path):
    """An option is covered by a row whose id starts with it and whose overrides set it."""
    rows = rows(tmp_path)
    missing = [key for key in options if not any(
        row_id.replace(".", "_").startswith(key.replace(".", "_")) and key in map(option_of, overrides)
        for row_id, overrides in rows)]
    assert not missing, f"options without a bad-value row: {missing}"


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(script) -> argparse.ArgumentParser:
    """The argument parser ``script.main`` builds, caught when it parses."""
    def catch(parser, *args, **kwargs):
        raise Parsed(parser)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(Parsed) as parsed:
            script.main([])
    return parsed.value.parser


@pytest.mark.parametrize("script", sorted(test_script_bad_input.SCRIPTS))
def test_every_script_option_that_takes_a_value_has_a_bad_value_row(script):
    rows = script_rows(script)
    missing = []
    for action in parser_of(test_script_bad_input.SCRIPTS[script])._actions:
        if not action.option_strings or action.nargs == 0:  # a positional argument, or a flag
            continue
        elsewhere = next((TESTED_ELSEWHERE[script, o] for o in action.option_strings if (script, o) in TESTED_ELSEWHERE), None)
        if elsewhere:
            file, name = elsewhere.split("::")
            source = (ROOT / "tests" / file).read_text()
            test = source[source.index(f"def {name}("):]
            assert action.dest.replace("_", "") in test.replace("_", "").replace("-", ""), (script, action.dest, elsewhere)
        elif not any(set(action.option_strings) & set(argv) for argv in rows):
            missing.append(action.option_strings[0])
    assert not missing, f"scripts/{script}.py options without a row in tests/test_script_bad_input.py: {missing}"


def test_the_tests_named_elsewhere_exist():
    for file, name in (where.split("::") for where in TESTED_ELSEWHERE.values()):
        assert f"def {name}(" in (ROOT / "tests" / file).read_text(), f"{file}::{name}"
    assert inspect.isfunction(test_script_bad_input.test_bad_input_is_one_error_line_and_writes_nothing)
