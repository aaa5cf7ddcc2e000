"""Recipe runs in processes of their own without paying for a fresh interpreter each time.

A run that must really die (a SIGKILL fault), needs process-wide limits or another working directory, or runs as
several ranks, gets processes of its own. A fresh ``python`` (or ``torchrun`` and its workers) spends 4-8 s of a
2-core machine importing torch, hydra and the recipes before the first step: most of a tiny run. These processes
are forked instead from one server per test process (multiprocessing's ``forkserver``) that imported all of that
once, from a single thread, before any tensor work: each child starts with the recipes loaded, sets its own
environment, working directory, process group and output files, and runs ``recipes/NAME.py``'s ``main`` (or a
script of the test's own, as ``python SCRIPT ARGS`` would).

Several ranks are started as torchrun starts its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, a rendezvous on
127.0.0.1, each worker a session of its own) and stopped as its agent stops them: when one fails, the others get
SIGTERM, then SIGKILL after ``STOP_GRACE_S``. The exit status is torchrun's (0, or 1 when a rank failed) for several
ranks and the child's own (a negative signal number when killed) for one. What torchrun itself adds (its elastic
agent, restarts, its failure report) is not here: the tests of that keep a real ``torchrun``.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"full": "full_finetune", "lora": "lora_finetune", "dpo": "dpo_finetune", "grpo": "grpo_finetune"}
STOP_GRACE_S = 30  # torchrun's agent: SIGTERM to the surviving workers, SIGKILL this long after
PRELOAD = ["tests.launch_preload"]


def _context():
    context = multiprocessing.get_context("forkserver")
    if str(ROOT) not in sys.path:  # the server gets this process's sys.path when it starts, and imports PRELOAD
        sys.path.insert(0, str(ROOT))
    context.set_forkserver_preload(PRELOAD)
    return context


@dataclass(frozen=True)
class FileSizeLimit:
    """A ``preexec_fn``: the process's writes past ``limit`` bytes fail with EFBIG (a full disk, for it alone)."""
    limit: int

    def __call__(self) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.limit))


def _child(recipe: str, argv: list[str], environ: dict, cwd: str | None, fault, preexec_fn, stdout: str,
           stderr: str) -> None:
    """One process's run: its environment, group, output files and fault, then ``main(argv)``'s status."""
    os.setsid()  # a session of its own, as torchrun's workers and the subprocess runs have: a group kill stays in it
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd or ROOT)
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (block-buffered as a pipe is: a kill loses what it held)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    code = 1
    try:
        import importlib

        import torch

        torch.set_num_threads(int(environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
        import threading

        from tqdm import tqdm

        # tqdm's default lock is a named semaphore, which a forkserver child would leave registered when it ends
        tqdm.set_lock(threading.RLock())
        if preexec_fn is not None:
            preexec_fn()
        from tests.faults import injected

        if recipe.endswith(".py"):  # a script: run as __main__ with its arguments
            import runpy

            sys.argv = [recipe, *argv]
            with injected(fault):
                runpy.run_path(recipe, run_name="__main__")
            code = 0
        else:
            main = importlib.import_module(f"recipes.{RECIPES[recipe]}").main
            with injected(fault):
                code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(recipe: str, argv: list[str], *, processes: int = 1, fault=None, env=None, cwd=None, preexec_fn=None,
           rank_env: list[dict] | None = None, timeout: float = 300) -> tuple[int, str, str, list[str]]:
    """``recipes/NAME.py`` (``recipe``: full, lora, dpo or grpo; or a script's path) with ``argv`` on ``processes``
    forked processes, in this process's environment with ``env`` added (a None value removes the variable), each
    with ``fault`` (``tests/faults.py``) injected, in ``cwd`` (the repository's root by default) after ``preexec_fn()``
    (picklable: a module's function or ``FileSizeLimit``), rank i's environment with ``rank_env[i]`` added last
    (several machines of one process each: ``{"LOCAL_RANK": "0", ...}``). Returns (exit status, stdout, stderr, each
    rank's stdout and stderr), the outputs in rank order as torchrun passes its workers' through."""
    context = _context()
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    environ = {k: v for k, v in environ.items() if v is not None}  # env's None: not in the run's environment
    if processes > 1:
        environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(processes),
                       LOCAL_WORLD_SIZE=str(processes), OMP_NUM_THREADS=environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="launch-") as logs:
        ranks = []
        for rank in range(processes):
            own = {**environ, "RANK": str(rank), "LOCAL_RANK": str(rank)} if processes > 1 else environ
            own.update((rank_env or [{}] * processes)[rank])
            outputs = (f"{logs}/{rank}.out", f"{logs}/{rank}.err")
            process = context.Process(target=_child, args=(recipe, argv, own, cwd and str(cwd), fault, preexec_fn, *outputs))
            process.start()
            ranks.append((process, outputs))
        codes = _wait([p for p, _ in ranks], timeout)
        outputs = [tuple(Path(path).read_text(errors="replace") for path in paths) for _, paths in ranks]
    code = codes[0] if processes == 1 else (0 if all(c == 0 for c in codes) else 1)
    return code, "".join(out for out, _ in outputs), "".join(err for _, err in outputs), [out + err for out, err in outputs]


def _wait(processes, timeout: float) -> list[int]:
    """Every process's exit status; the first to fail has the rest stopped as torchrun's agent stops them."""
    deadline, stopping = time.monotonic() + timeout, None
    while any(p.exitcode is None for p in processes):
        now = time.monotonic()
        failed = any(p.exitcode not in (None, 0) for p in processes)
        if now > deadline:
            _signal(processes, signal.SIGKILL)
            raise TimeoutError(f"a launched run took over {timeout} s")
        if failed and stopping is None:
            stopping = now
            _signal(processes, signal.SIGTERM)
        elif stopping is not None and now - stopping > STOP_GRACE_S:
            _signal(processes, signal.SIGKILL)
        time.sleep(0.05)
    for p in processes:
        p.join()
    return [p.exitcode for p in processes]


def _signal(processes, sig) -> None:
    for p in processes:
        if p.exitcode is None:
            try:
                os.killpg(p.pid, sig)  # the whole session: the rank and anything it started
            except ProcessLookupError:
                pass


def forked_fresh_process(script: Path):
    """A benchmark's ``fresh_process(argv)`` (its script in a Python of its own, its stdout) as a process forked from
    the launch server: as fresh for what it measures (its own memory, from a reset peak), without the 3-4 s of
    imports a new interpreter pays."""
    def fresh_process(argv: list[str]) -> str:
        code, out, err, _ = launch(str(script), list(argv))
        if code != 0:
            raise RuntimeError(f"{script.name} {' '.join(argv)} exited {code}:\n{err[-3000:]}")
        return out
    return fresh_process
