"""``waypoint``: one command over the recipes, configs and scripts that ship with Waypoint (``cli.shipped``).

    waypoint ls                                         the recipes and the configs each ships with
    waypoint cp tiny_lora my_lora.yaml                  a recipe or config copied out to edit
    waypoint run full_finetune --config tiny [key=value ...]
    waypoint run --nproc-per-node 2 full_finetune --config tiny   (torchrun's own launcher)
    waypoint validate tiny_lora lora.rank=0             compose and check, read and write nothing
    waypoint download | convert | inspect | merge-lora | generate | plot ...

Each subcommand is a thin layer: ``run`` executes the recipe file as ``python RECIPE.py`` would (so a copy edited
after ``waypoint cp`` runs the same way), ``--nproc-per-node`` hands the same command line to
``torch.distributed.run``, and the script subcommands run ``scripts/*.py`` (``generate``: ``recipes/generate.py``)
with the arguments given. Errors are one line, as every command's.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

from waypoint.cli.command import DEBUG, OneLineParser
from waypoint.cli.shipped import configs, find_config, find_recipe, recipe_of, recipes, scripts

USAGE = __doc__.split("\n\n")[1]
ALIASES = {"plot": "plot-metrics"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: waypoint COMMAND ...\n\n{USAGE}\n\n`waypoint COMMAND --help` says more about each.")
        return 0 if argv else 2
    command, rest = ALIASES.get(argv[0], argv[0]), argv[1:]
    handlers = {"ls": ls, "cp": cp, "run": run, "validate": validate}
    try:
        if command in handlers:
            return handlers[command](rest)
        if command == "generate":
            return _execute(find_recipe("generate"), rest, "waypoint generate")
        if command in scripts():
            return _execute(scripts()[command], rest, f"waypoint {command}")
        raise LookupError(f"unknown command {command!r}: one of {', '.join([*handlers, 'generate', *scripts()])}")
    except LookupError as e:
        if os.environ.get(DEBUG):
            raise
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse's --help and usage errors, as an exit status
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def ls(argv: list[str]) -> int:
    OneLineParser(prog="waypoint ls", description="List the recipes and the configs each ships with "
                  "(e.g. `waypoint ls`).").parse_args(argv)
    by_recipe: dict[str, list[str]] = {name: [] for name in recipes()}
    for name, path in configs().items():
        by_recipe.setdefault(recipe_of(path) or "(no recipe named)", []).append(name)
    width = max(map(len, by_recipe)) + 2
    for recipe, names in by_recipe.items():
        print(textwrap.fill(", ".join(names) or "-", 110, initial_indent=f"{recipe:<{width}}",
                            subsequent_indent=" " * width, break_on_hyphens=False))
    return 0


def cp(argv: list[str]) -> int:
    parser = OneLineParser(prog="waypoint cp", description="Copy a shipped recipe or config out to edit, e.g. "
                           "`waypoint cp tiny_lora my_lora.yaml`, then `waypoint run lora_finetune --config my_lora.yaml`.")
    parser.add_argument("name", help="a recipe (full_finetune) or config (tiny_lora) name")
    parser.add_argument("dest", help="the file (or folder) to write; an existing file is never overwritten")
    args = parser.parse_args(argv)
    source = recipes().get(Path(args.name).stem) if Path(args.name).suffix in ("", ".py") else None
    source = source or configs().get(Path(args.name).stem)
    if source is None:
        parser.error(f"{args.name!r} is neither a shipped recipe nor a shipped config (`waypoint ls` lists them)")
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / source.name
    if dest.is_symlink() and not dest.exists():  # GNU cp refuses too: the file would land wherever the link points
        parser.error(f"{dest} is a symbolic link to {os.readlink(dest)}, which does not exist; cp writes nothing "
                     "through it: remove the link or choose another name")
    if dest.exists():
        parser.error(f"{dest} exists; choose another name (nothing was overwritten)")
    if not dest.parent.is_dir():
        parser.error(f"{dest.parent}: no such folder")
    try:
        _copy_new(source, dest)
    except FileExistsError:  # made between the look and the write
        parser.error(f"{dest} exists; choose another name (nothing was overwritten)")
    except OSError as e:
        if os.environ.get(DEBUG):
            raise
        print(f"error: {dest}: cannot write it ({e.strerror or e}); choose a folder you can write (nothing was "
              "written)", file=sys.stderr)
        return 1
    print(f"copied {source.name} to {dest}")
    return 0


def _copy_new(source: Path, dest: Path) -> None:
    """``source``'s bytes as the new file ``dest``: created exclusively, never through a symbolic link (an existing
    name, a link among them, is FileExistsError), and removed again if the copy fails half way."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(dest, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as data:
            shutil.copyfileobj(data, out)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


def run(argv: list[str]) -> int:
    parser = OneLineParser(prog="waypoint run", description="Run a recipe (by name, or a recipe file) on a config "
                           "(by name, or a file), e.g. `waypoint run full_finetune --config tiny epochs=1`.")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None,
                        help="processes on this machine, through torchrun (torch.distributed.run)")
    parser.add_argument("recipe")
    args, rest = parser.parse_known_args(argv)
    recipe = find_recipe(args.recipe)
    if args.nproc_per_node is None:
        return _execute(recipe, rest, f"waypoint run {args.recipe}")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: expected a positive number")
    from torch.distributed.run import main as torchrun

    try:
        torchrun([f"--nproc-per-node={args.nproc_per_node}", str(recipe), *rest])
    except Exception as e:  # torchrun's ChildFailedError: the ranks' own errors were printed above
        if os.environ.get(DEBUG):
            raise
        print(f"error: {type(e).__name__}: a process of the run failed (its error is above)", file=sys.stderr)
        return 1
    return 0


def validate(argv: list[str]) -> int:
    parser = OneLineParser(prog="waypoint validate", description="Compose a config and check its options, reading no "
                           "checkpoint and writing nothing, e.g. `waypoint validate tiny_lora lora.rank=0`.")
    parser.add_argument("config", help="a config file, or a shipped config's name")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--recipe", help="the recipe whose checks apply (default: the one the config's header names)")
    args = parser.parse_args(argv)
    from waypoint.cli.validate import problems

    path = find_config(args.config)
    name = args.recipe or recipe_of(path)
    found = problems(path, args.overrides, find_recipe(name) if name else None)
    for line in found:
        print(f"error: {line}")
    if not found:
        print(f"{path}: ok for {name or 'the common options'}")
    return 1 if found else 0


def _execute(path: Path, argv: list[str], prog: str) -> int:
    """``python PATH ARGV`` in this process: its ``__main__``, its exit status; its usage lines say ``prog`` (runpy
    would name the file instead)."""
    saved = sys.argv[:]
    sys.argv = [prog, *argv]
    try:
        code = compile(path.read_bytes(), str(path), "exec")
        exec(code, {"__name__": "__main__", "__file__": str(path), "__builtins__": __builtins__})
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("message"): what the interpreter would print
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
