"""What every recipe's ``main`` does around its ``train(cfg, dist)``: compose and check the config before
anything is read or written, start the process group, hold ``output_dir`` for the run's life
(``waypoint.training.run_dir``), turn bad input into a one-line ``error: ...`` (exit 1;
``WAYPOINT_DEBUG=1`` shows the traceback), and give back the signal handlers it installed, since
``main`` may run inside another program (tests, notebooks)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping

from omegaconf import DictConfig

from waypoint.models.swap import swapping_conversions
from waypoint.training.cli import run_command
from waypoint.training.config import parse_config
from waypoint.training.config_checks import COMMON, Check
from waypoint.training.distributed import Distributed, init_distributed
from waypoint.training.object_store_run import object_store_output
from waypoint.training.run_dir import hold_output_dir


def run_recipe(train: Callable[[DictConfig, Distributed], int], argv: list[str] | None, description: str,
               example: str = "configs/tiny.yaml", checks: Mapping[str, tuple[bool, Check]] = COMMON) -> int:
    cfg = parse_config(argv, description=description, example=example, checks=checks)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def run() -> int:
        dist = init_distributed(cfg.device)  # under torchrun: one process per GPU (or CPU), else a single process
        try:
            # swapping_conversions: a parameter converted or loaded after the optimizer exists stays the object
            # the optimizer holds (waypoint.models.swap)
            with object_store_output(cfg, dist), hold_output_dir(cfg, dist), swapping_conversions():  # one run per output_dir, apart from everything it reads
                status = train(cfg, dist)
            dist.barrier()  # every rank past its last collective before any tears the process group down
            return status
        finally:
            dist.close()

    try:
        return run_command(run)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
