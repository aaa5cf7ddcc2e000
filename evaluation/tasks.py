"""The tasks to run, checked before the model is read: each a name lm-eval knows (a task, group or tag), one
in a folder of ``include_path``, a glob over those names (``mmlu_*``), or a task's YAML file.

Indexing lm-eval's own ~15,000 task files takes seconds, so when every task is found in ``include_path`` or is a
YAML file of a single task, only those folders are indexed (a group's file may name lm-eval's tasks, and a glob may
match some: the whole index then). An unknown name is one line with the nearest names.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from waypoint.errors import CheckpointError, first_line

GLOB = set("*?[")


def task_list(tasks) -> list[str]:
    """``tasks`` as a list of names: a list, or one string of comma-separated names (lm-eval's command line)."""
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    return [name.strip() for name in names if name.strip()]


def include_paths(include_path) -> list[Path]:
    paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
    for path in map(Path, paths):
        if not path.is_dir():
            raise CheckpointError(f"include_path={path}: no such directory (a folder of lm-eval task YAML files)")
    return [Path(p) for p in paths]


def is_task_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml"))


def stands_alone(name: str) -> bool:
    """Whether a task file is one task (``task: NAME``), not a group or a list that may name lm-eval's own tasks."""
    text = Path(name).read_text(encoding="utf-8")
    return not re.search(r"^group\s*:", text, re.M) and bool(re.search(r"^task\s*:\s*\S", text, re.M))


def yaml_problem(e, path=None) -> str:
    """A YAML error as one line naming the file, line and column (``path`` where the error names none)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = getattr(mark, "name", None) if mark is not None else None
    where = str(path) if path is not None and (not where or where.startswith("<")) else where or "a task file"
    at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(e, "problem", None) or first_line(e)
    return f"{where}{at}: not valid YAML ({what}); fix the task file"


def check_task_file(name: str) -> None:
    """A task file that exists and parses as YAML (lm-eval's tags, ``!function``, taken as they come), or one line."""
    import yaml

    path = Path(name)
    if not path.is_file():
        raise CheckpointError(f"tasks: {name}: no such task file")

    class Tags(yaml.SafeLoader):
        pass
    Tags.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        yaml.load(path.read_text(encoding="utf-8"), Loader=Tags)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"tasks: {name}: not a text file ({e.reason} at byte {e.start}); give a task's YAML file") from None
    except yaml.YAMLError as e:
        raise CheckpointError(f"tasks: {yaml_problem(e, path)}") from None


def resolve(tasks, include_path=None) -> tuple[object, list[str]]:
    """(an lm-eval TaskManager that knows every task asked for, the task names with globs expanded)."""
    from lm_eval.tasks import TaskManager

    names, paths = task_list(tasks), include_paths(include_path)
    for name in filter(is_task_file, names):
        check_task_file(name)
    folders = [str(p) for p in paths] or None
    # only the given folders first, where nothing may need lm-eval's own tasks (a glob may match some of them)
    alone = all(stands_alone(n) if is_task_file(n) else not GLOB & set(n) for n in names)
    managers = [lambda: TaskManager(include_path=folders, include_defaults=False)] if alone else []
    managers.append(lambda: TaskManager(include_path=folders))
    for make in managers:
        manager = make()
        known = set(manager.all_tasks)
        expanded, unknown = [], []
        for name in names:
            if is_task_file(name) or name in known:
                expanded.append(name)
            elif GLOB & set(name) and manager.match_tasks([name]):
                expanded += manager.match_tasks([name])
            else:
                unknown.append(name)
        if not unknown:
            return manager, list(dict.fromkeys(expanded))
    near = difflib.get_close_matches(unknown[0], sorted(known), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    where = f" nor in include_path ({', '.join(map(str, paths))})" if paths else ""
    raise CheckpointError(f"tasks: unknown task {unknown[0]!r}{hint}: not one of lm-eval's tasks{where}; "
                          "`lm-eval ls tasks` lists them, or give a task's YAML file")
