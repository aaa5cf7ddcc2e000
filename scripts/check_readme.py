"""Run the README's examples as a new user would: every ```bash block, in order, in a fresh copy of the checkout.

    python scripts/check_readme.py [--readme README.md] [--keep]

A ```bash block holds examples that run as written on a CPU machine without the network; a ```sh block needs a GPU,
the network or your own data, and is shown, not run. In a bash block each line is a command (a trailing backslash
continues it). The set-up's ``python3 -m venv``, ``. .venv/bin/activate`` and ``pip install`` are what the install
has done already, and are skipped (said so); so are ``python -m pytest`` and this script, the tests themselves.

A command fails the check when it exits with a non-zero status, when a training command trains nothing ("nothing to
do") unless the very same command ran before it (a rerun resumes, by design), when its output lacks what
``EXPECT`` says it prints, or when the figures the README quotes from its run's ``metrics.jsonl`` are not those
(``HELD_OUT``). The copy holds the checkout's files (tracked and untracked, none that git ignores, so no
``outputs/``); commands run there with this Python's environment first on PATH (``python``, ``waypoint``,
``torchrun``). Exit status 1 on any failure, each named with the end of its output; ``--keep`` keeps the copy.

Commands that share nothing run side by side (``--jobs``, default 2: this machine's cores), each after every earlier
command it shares something with, so each sees what it would see in order: what two commands share is an
``outputs/NAME`` folder (named in the command or in the config it runs), a file named in the checkout's root
(``my_lora.yaml``), or torchrun's rendezvous port. A command whose config is not there yet waits for all before it.
Side by side, each command computes on one thread (``OMP_NUM_THREADS=1``, as torchrun gives its workers): the
figures the README quotes are the same on one thread as on two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SETUP = re.compile(r"^(python3? -m venv\b|\. \.venv/bin/activate$|source \.venv/bin/activate$|pip install\b)")
SUITE = re.compile(r"^python3? (-m pytest\b|scripts/check_readme\.py\b)")  # the tests, and this check itself
NOTHING_DONE = ("nothing to do",)
# command (a substring of it) -> what its output must contain: the demos' promises in the README's text
EXPECT = {
    "waypoint validate tiny_lora lora.rank=0": "lora.rank=0",
    "recipes/grpo_finetune.py --config configs/tiny_grpo.yaml": "val_reward 0.513",  # the progress line it quotes
}
# command (a substring of it) -> the last line its stdout must end with: a reply that stopped at the end of its turn
# (generate.py prints the reply alone on stdout; its load report and token count go to stderr)
REPLY = {
    'checkpoint_dir=outputs/tiny_vlm/step_120 image=assets/tiny_vlm/held_out/red.png prompt="What colour is this?"': "Red.",
    'checkpoint_dir=outputs/tiny_chat/step_300 prompt="What is the capital of Peru?"': "The capital of Peru is Lima.",
    # DPO after that SFT keeps what SFT taught (the pair is in the DPO data too, "Lima" chosen)
    'checkpoint_dir=outputs/tiny_dpo/step_36 prompt="What is the capital of Peru?"': "The capital of Peru is Lima.",
}
# command (a substring of it) -> its run's metrics.jsonl, its loss.beta, and the held-out figures the README quotes from
# that file's last held-out record (held_out): the DPO demo's chosen answers more likely than at the reference
HELD_OUT = {
    "recipes/dpo_finetune.py --config configs/tiny_dpo.yaml checkpointer.checkpoint_dir=outputs/tiny_chat/step_300":
        ("outputs/tiny_dpo/metrics.jsonl", 0.1, (-90.9, -88.2, 4.2)),
}
TIMEOUT_S = 900


def held_out(metrics: Path, beta: float) -> tuple[float, float, float]:
    """(``val_logps/chosen`` at the reference, after, ``val_rewards/margins``) of a preference run's last held-out
    record, each to 0.1 as the README quotes them; the reference's is the policy's less ``val_rewards/chosen`` / beta
    (a reward is beta times the policy's log-prob less the reference's)."""
    last = [r for r in map(json.loads, metrics.read_text(encoding="utf-8").splitlines()) if "val_logps/chosen" in r][-1]
    chosen = last["val_logps/chosen"]
    return (round(chosen - last["val_rewards/chosen"] / beta, 1), round(chosen, 1), round(last["val_rewards/margins"], 1))


def commands(readme: str) -> list[str]:
    """The commands of the ```bash blocks, in order."""
    found, block, pending = [], False, ""
    for line in readme.splitlines():
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            found.append(line)
    return found


def steps(command: str) -> tuple[list[str], str | None]:
    """(the set-up steps skipped, what remains to run) of a ``a && b && c`` line."""
    parts = [p.strip() for p in command.split(" && ")]
    skipped = [p for p in parts if SETUP.match(p)]
    rest = [p for p in parts if not SETUP.match(p)]
    return skipped, (" && ".join(rest) if rest else None)


def bare(command: str) -> str:
    """The command without its trailing comment: the same command, however the README annotates it."""
    return re.sub(r"\s+#\s.*$", "", command)


OUTPUT = re.compile(r"\boutputs/[\w.-]+")
ROOT_FILE = re.compile(r"^[\w.-]+\.(yaml|yml|json|jsonl)$")  # a file of the user's in the checkout's root
DISTRIBUTED = re.compile(r"^torchrun\b|--nproc[-_]per[-_]node\b")
EVERYTHING = None  # what a command shares when it cannot be told: it waits for all before it


def config_strings(path: Path) -> list[str]:
    """Every string value of a YAML config (comments aside)."""
    found, stack = [], [yaml.safe_load(path.read_text(encoding="utf-8"))]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            found.append(item)
    return found


def shared(command: str, checkout: Path) -> set[str] | None:
    """What ``command`` shares with other commands (module docstring), or EVERYTHING."""
    words = shlex.split(bare(command))
    found = set(OUTPUT.findall(command))
    found |= {"file:" + w for w in words if ROOT_FILE.match(w)}
    if DISTRIBUTED.search(command):
        found.add("port:torchrun")
    for flag, value in zip(words, words[1:]):
        if flag == "--config":
            named = [checkout / value, checkout / "configs" / value, checkout / "configs" / f"{value}.yaml"]
            config = next((c for c in named if c.is_file()), None)
            if config is None:
                return EVERYTHING
            found |= {m for text in config_strings(config) for m in OUTPUT.findall(text)}
    return found


def after(plan: list[str], checkout: Path) -> list[set[int]]:
    """For each command, the earlier ones it must wait for."""
    shares = [shared(c, checkout) for c in plan]
    return [set(range(i)) if mine is EVERYTHING else
            {j for j in range(i) if shares[j] is EVERYTHING or shares[j] & mine} for i, mine in enumerate(shares)]


def fresh_copy(target: Path) -> Path:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def run(command: str, copy: Path, env: dict[str, str]) -> tuple[int | str, str, str, float]:
    """(exit status or "timeout", stdout and stderr, stdout's last line, seconds) of one command in the copy."""
    began = time.perf_counter()
    try:
        done = subprocess.run(["bash", "-c", command], cwd=copy, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        status, output, reply = done.returncode, done.stdout + done.stderr, (done.stdout.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired as e:
        status, output, reply = "timeout", f"{e.stdout or ''}{e.stderr or ''}", ""
    return status, output, reply, time.perf_counter() - began


def problem_of(command: str, earlier: list[str], copy: Path, status, output: str, reply: str) -> str | None:
    """What is wrong with a command's run (None: nothing); ``earlier``: the commands before it in the README."""
    if status != 0:
        return f"exit status {status}"
    if any(n in output for n in NOTHING_DONE) and bare(command) not in map(bare, earlier):
        return "it trained nothing (an earlier example left its output_dir finished)"
    missing = [want for key, want in EXPECT.items() if key in command and want not in output]
    unlike = [want for key, want in REPLY.items() if key in command and reply != want]
    drifted = [(got, want) for key, (path, beta, want) in HELD_OUT.items() if key in command
               for got in [held_out(copy / path, beta)] if got != want]
    return (f"its output lacks {missing[0]!r}" if missing else
            f"its reply does not end, and stop, at {unlike[0]!r}" if unlike else
            f"its held-out figures (reference, after, margin) are {drifted[0][0]}, not the README's "
            f"{drifted[0][1]}" if drifted else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--keep", action="store_true", help="keep the copy the commands ran in")
    parser.add_argument("--jobs", type=int, default=2, help="commands run side by side at most (default 2)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="readme_check_"))
    copy = fresh_copy(work / "checkout")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    if args.jobs > 1:  # one thread a command: two runs' thread pools on 2 cores spin against each other (5x slower)
        env.setdefault("OMP_NUM_THREADS", "1")
    plan = []
    for command in commands(args.readme.read_text(encoding="utf-8")):
        skipped, rest = steps(command)
        for step in skipped:
            print(f"skip (the install did it): {step}")
        if rest is None:
            continue
        if SUITE.match(rest):
            print(f"skip (the tests themselves): {rest}")
            continue
        plan.append(rest)
    waits, finished, failures, started = after(plan, copy), set(), [], time.perf_counter()
    running = {}  # future -> the index of the command it runs
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        while len(finished) < len(plan):
            for i in range(len(plan)):  # in the README's order, as slots free up
                if len(running) < max(1, args.jobs) and i not in finished and i not in running.values() \
                        and waits[i] <= finished:
                    running[pool.submit(run, plan[i], copy, env)] = i
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                i = running.pop(future)
                status, output, reply, seconds = future.result()
                problem = problem_of(plan[i], plan[:i], copy, status, output, reply)
                finished.add(i)
                print(f"{'FAIL' if problem else 'ok  '} {seconds:6.1f} s  {plan[i]}", flush=True)
                if problem:
                    failures.append(plan[i])
                    print(f"     {problem}; the end of its output:\n"
                          + "\n".join("     | " + line for line in output.splitlines()[-15:]), flush=True)
    print(f"{len(set(map(bare, plan)))} README commands in {time.perf_counter() - started:.0f} s, {len(failures)} failed"
          + (f"; kept {copy}" if args.keep else ""))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
