"""Which library modules run during one save, and during one resume, of the tiny single-process HF fine-tune: a
measure of how many modules a reader opens to follow either (the run/ redesign took them from 20 and 9 to 18 and 8).

    python scripts/trace_modules.py [--root REPO] [--save FUNC[,FUNC]] [--resume FUNC[,FUNC]]

It runs recipes/full_finetune.py in process on configs/tiny.yaml, 2 steps saved at each step, then resumes it for 2
more, and records every module of the library whose code runs inside the named functions (qualified names; the
defaults are the recipe's ``save`` closure, and ``RunStart.__init__`` and ``RunStart.restore`` for a resume).
``--root`` measures another checkout (an older commit, with its own function names).
"""
import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the checkout to measure")
parser.add_argument("--save", default="save", help="the functions a save runs inside")
parser.add_argument("--resume", default="RunStart.__init__,RunStart.restore", help="the functions a resume runs inside")
args = parser.parse_args()
root = Path(args.root).resolve()
sys.path.insert(0, str(root))
os.chdir(root)
LIBRARY = [str(root / d) + "/" for d in ("checkpointers", "converters", "families", "models", "training", "waypoint",
                                         "run", "text", "cli")]


def traced(targets, fn):
    names = set(targets.split(","))
    seen, depth = set(), [0]

    def named(code) -> bool:  # a method's qualified name; a closure's own name (``save`` in ``train.<locals>.save``)
        qualname = getattr(code, "co_qualname", code.co_name)  # Python >= 3.11 has qualified names
        return qualname in names or qualname.split(".<locals>.")[-1] in names

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call":
            if named(code):
                depth[0] += 1
            if depth[0] and any(code.co_filename.startswith(p) for p in LIBRARY):
                seen.add(os.path.relpath(code.co_filename, root))
        elif event == "return" and named(code):
            depth[0] -= 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(seen)


os.environ.setdefault("WAYPOINT_CACHE", tempfile.mkdtemp())
from recipes import full_finetune  # noqa: E402

out = Path(tempfile.mkdtemp())
base = ["--config", "configs/tiny.yaml", f"output_dir={out}", "max_steps_per_epoch=2", "verify_export=false",
        "save_every_n_steps=1"]
save = traced(args.save, lambda: full_finetune.main(base + ["epochs=1"]))
resume = traced(args.resume, lambda: full_finetune.main(base + ["epochs=2"]))
shutil.rmtree(out)
for label, modules in (("save", save), ("resume", resume)):
    print(f"{label}: {len(modules)} modules")
    for m in modules:
        print("   ", m)
