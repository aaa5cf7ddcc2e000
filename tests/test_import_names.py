"""Every import name is under `waypoint`: nothing we install collides with other distributions' top-level
packages (llama-models, Meta's reference code, installs a top-level `models`; the test extras install it)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from tests.conftest import ROOT


def test_the_distribution_installs_one_import_name():
    names = sorted(name for name, dists in metadata.packages_distributions().items() if "waypoint" in dists)
    assert names == ["waypoint"]


def test_imports_and_a_recipe_work_beside_llama_models_outside_the_repository(tmp_path):
    probe = ("import models, waypoint.checkpointers, waypoint.training.config\n"
             "from waypoint.checkpointers import load_model\n"
             f"model = load_model({str(ROOT / 'assets/tiny_llama')!r})\n"
             "print(models.__file__)\n")
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert "llama_models" in metadata.packages_distributions().get("models", []), "pip install -e '.[test]' installs llama-models"
    assert found.stdout.strip() != str(ROOT / "models/__init__.py"), "the top-level `models` is llama-models', not ours"

    run = subprocess.run([sys.executable, str(ROOT / "recipes/full_finetune.py"), "--config", str(ROOT / "configs/tiny.yaml"),
                          f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}",
                          f"output_dir={tmp_path / 'out'}", "epochs=1", "max_steps_per_epoch=2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "out" / "step_2" / "MANIFEST.json").is_file()


# each layer imports only from the layers before it (and itself): no arrow runs back up
LAYERS = ["errors", "lazy", "models", "converters", "families", "checkpointers", "training"]
FOLDERS = {"errors": "waypoint/errors.py", "lazy": "waypoint/lazy.py", "models": "models", "converters": "converters",
           "families": "families", "checkpointers": "checkpointers", "training": "training"}
ALLOWED = {"models": {"errors", "lazy", "models"}, "converters": {"errors", "lazy", "converters"}}


def test_layers_import_only_downwards():
    import ast

    problems = []
    for layer, folder in FOLDERS.items():
        allowed = ALLOWED.get(layer, set(LAYERS[:LAYERS.index(layer) + 1]))
        for path in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else [ROOT / folder]:
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "waypoint" and len(parts) > 1 and parts[1] not in allowed:
                        problems.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not problems, problems
