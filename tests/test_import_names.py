"""Every import name is under `waypoint`: nothing we install collides with other distributions' top-level
packages (llama-models, Meta's reference code, installs a top-level `models`; the test extras install it)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tests.conftest import ROOT


def test_the_distribution_installs_one_import_name():
    names = sorted(name for name, dists in metadata.packages_distributions().items() if "waypoint" in dists)
    assert names == ["waypoint"]


def test_imports_and_a_recipe_work_beside_llama_models_outside_the_repository(tmp_path):
    """In one fresh Python outside the checkout: recipes/full_finetune.py run as ``python recipes/full_finetune.py``
    runs it (its folder first on sys.path), then the top-level ``models`` is still llama-models' and our packages load
    a checkpoint beside it."""
    recipe = ROOT / "recipes/full_finetune.py"
    argv = [str(recipe), "--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
            f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", f"output_dir={tmp_path / 'out'}", "epochs=1", "max_steps_per_epoch=2"]
    probe = ("import runpy, sys\n"
             f"sys.argv, sys.path[0] = {argv!r}, {str(recipe.parent)!r}\n"
             "try:\n"
             f"    runpy.run_path({str(recipe)!r}, run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    assert e.code in (0, None), f'the recipe exited {e.code}'\n"
             "sys.path[0] = ''\n"
             "import models, waypoint.checkpointers, waypoint.cli.config\n"
             "from waypoint.checkpointers import load_model\n"
             f"model = load_model({str(ROOT / 'assets/tiny_llama')!r})\n"
             "print(models.__file__)\n")
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-2000:]
    assert (tmp_path / "out" / "step_2" / "MANIFEST.json").is_file()
    assert "llama_models" in metadata.packages_distributions().get("models", []), "pip install -e '.[test]' installs llama-models"
    assert found.stdout.strip().splitlines()[-1] != str(ROOT / "models/__init__.py"), "the top-level `models` is llama-models', not ours"


# Each package imports only from the packages below it (and itself): no arrow runs back up. `run` (a run's life in its
# output_dir) and `training` (what a step is made of) stand side by side above `checkpointers`: neither imports the
# other; the recipes and `cli` put them together.
BELOW = {
    "errors": set(), "lazy": {"errors"}, "mxfp4": set(), "fp8": set(), "console": set(),
    "models": {"errors", "lazy", "mxfp4", "fp8"},
    "converters": {"errors", "lazy", "mxfp4", "fp8"},
    "families": {"errors", "lazy", "models", "converters", "mxfp4", "fp8"},
    "checkpointers": {"errors", "console", "lazy", "models", "converters", "mxfp4", "fp8", "families"},
    "text": {"errors"},
    "vision": {"errors"},  # images for vision-language models: files and each family's processor
    "rewards": {"errors"},  # an online-RL run's reward functions (plain Python over completions)
    "agents": {"errors", "text", "rewards"},  # multi-turn RL: tools, their calls' formats, the turn loop
    "data": {"errors", "models", "text", "vision"},  # what a run trains on: datasets, records, packing, batches
    "run": {"errors", "console", "lazy", "models", "converters", "mxfp4", "fp8", "families", "checkpointers",
            "text"},  # a LoRA step writes the tokenizer files and chat template beside its adapter
    "training": {"errors", "console", "lazy", "models", "converters", "mxfp4", "fp8", "families", "checkpointers", "text",
                 "rewards", "vision", "data", "agents"},  # an online-RL step scores its samples (and runs tools)
    "cli": {"errors", "console", "lazy", "models", "converters", "mxfp4", "fp8", "families", "checkpointers", "text", "run", "training",
            "rewards", "vision", "data", "agents"},
    # lm-evaluation-harness over a loaded checkpoint (recipes/eval.py): the top, above cli (an adapter's base name)
    "evaluation": {"errors", "console", "lazy", "models", "converters", "mxfp4", "fp8", "families", "checkpointers", "text", "run",
                   "training", "cli", "rewards", "vision", "data", "agents"},
}
PACKAGES = [p for p in BELOW if p not in ("errors", "lazy", "mxfp4", "fp8", "console")]


def library_modules() -> dict[str, Path]:
    """Import name -> file of every library module."""
    modules = {f"waypoint.{p.stem}": p for p in (ROOT / "waypoint").glob("*.py") if p.stem != "__init__"}
    for package in PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            modules[f"waypoint.{package}" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return modules


def imported(path, modules) -> set[str]:
    """The library modules a file imports, at the top or inside a function (``from pkg import submodule`` names the
    submodule)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            names |= set(submodules) or {node.module}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n in modules}


def package_of(module: str) -> str:
    return module.split(".")[1]


def test_packages_import_only_downwards():
    modules = library_modules()
    assert len(modules) > 80 and {package_of(m) for m in modules} == set(BELOW), "every package is named in BELOW"
    problems = [f"{path.relative_to(ROOT)} imports {name}" for module, path in modules.items()
                for name in imported(path, modules)
                if package_of(name) != package_of(module) and package_of(name) not in BELOW[package_of(module)]]
    assert not problems, problems


def test_no_module_imports_itself_through_a_circle():
    modules = library_modules()
    graph = {m: imported(p, modules) - {m} for m, p in modules.items()}
    circles, done = [], set()

    def visit(module, path):
        for nxt in sorted(graph[module]):
            if nxt in path:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(module)
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles, circles


def test_the_recipes_do_not_import_the_hub_client():
    """A recipe names an adapter's base from the download's record (``cli.hub_source``) without importing
    huggingface_hub: on a GPU machine whose huggingface_hub was older than ours, every LoRA-family recipe died at its
    import of the hub client's network stack (httpx2), before it read its config."""
    probe = ("import importlib.util, sys\n"
             "for name in ('full_finetune', 'lora_finetune', 'dpo_finetune', 'grpo_finetune', 'generate'):\n"
             f"    spec = importlib.util.spec_from_file_location(name, {str(ROOT / 'recipes')!r} + f'/{{name}}.py')\n"
             "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
             "print(sorted(m for m in ('huggingface_hub', 'httpx2', 'transformers') if m in sys.modules))\n")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip() == "[]"
