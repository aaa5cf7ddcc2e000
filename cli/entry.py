"""What every recipe's ``main`` does around its ``train(cfg, dist)``: compose and check the config before
anything is read or written, start the process group, find where the run works (an object store's local mirror,
with the store's lock), hold ``output_dir`` for the run's life (``waypoint.run.output_dir``), turn bad input into a
one-line ``error: ...`` (exit 1; ``WAYPOINT_DEBUG=1`` shows the traceback), and give back the signal handlers it
installed, since ``main`` may run inside another program (tests, notebooks)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from waypoint.cli.command import run_command
from waypoint.cli.config import parse_config
from waypoint.cli.option_checks import COMMON, Check
from waypoint.cli.run_config import cache_inputs, use_run_dir
from waypoint.console import lines_as_printed, progress_shown
from waypoint.models.swap import swapping_conversions
from waypoint.run.output_dir import hold_output_dir, run_inputs
from waypoint.run.store_run import run_dir_for
from waypoint.training.distributed import Distributed, init_distributed


def run_recipe(train: Callable[[DictConfig, Distributed], int], argv: list[str] | None, description: str,
               example: str = "configs/tiny.yaml", checks: Mapping[str, tuple[bool, Check]] = COMMON) -> int:
    cfg = parse_config(argv, description=description, example=example, checks=checks)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def run() -> int:
        dist = init_distributed(cfg.device)  # under torchrun: one process per GPU (or CPU), else a single process
        try:
            cache_inputs(cfg, dist)  # inputs at object-store URLs: local copies on every machine
            with run_dir_for(str(cfg.output_dir), dist) as run_dir:
                use_run_dir(cfg, run_dir)
                inputs = run_inputs(OmegaConf.to_container(cfg, resolve=True))
                # one run per output_dir, apart from everything it reads; swapping_conversions: a parameter converted
                # or loaded after the optimizer exists stays the object the optimizer holds (waypoint.models.swap)
                with hold_output_dir(run_dir.path, inputs, dist), swapping_conversions():
                    status = train(cfg, dist)
            dist.barrier()  # every rank past its last collective before any tears the process group down
            return status
        finally:
            dist.close()

    try:
        # bars on a terminal, plain lines in a log, each line there as it is printed (waypoint.console)
        with progress_shown(cfg.get("progress", "auto")), lines_as_printed():
            return run_command(run)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
