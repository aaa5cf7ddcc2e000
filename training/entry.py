"""What every recipe's ``main`` does around its ``train``: compose the config, turn bad input into a
one-line ``error: ...`` (exit 1; ``WAYPOINT_DEBUG=1`` shows the traceback), and give back the
signal handlers it installed, since ``main`` may run inside another program (tests, notebooks)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from hydra.errors import InstantiationException
from omegaconf import DictConfig

from waypoint.converters.errors import CheckpointError
from waypoint.training.config import parse_config


def run_recipe(train: Callable[[DictConfig], int], argv: list[str] | None, description: str) -> int:
    cfg = parse_config(argv, description=description)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return train(cfg)
    except (CheckpointError, FileNotFoundError, InstantiationException) as e:
        if os.environ.get("WAYPOINT_DEBUG"):
            raise
        cause = e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ else e
        rank = int(os.environ.get("RANK", "0"))  # under torchrun every rank reports; rank 0 unprefixed
        print(f"\n{f'[rank {rank}] ' if rank else ''}error: {str(cause).splitlines()[0]}", file=sys.stderr)  # after any progress bar
        return 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
