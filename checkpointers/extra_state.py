"""Module extra state in checkpoints: kept out of the weight files, in a sidecar the manifest covers.

Weight formats hold tensors only (safetensors) or are read by tools that expect
tensors only (HF, Meta ``.pth``), so ``*._extra_state`` entries of a native state
dict travel in ``extra_state.pt``, which loads with ``weights_only=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from waypoint.errors import CheckpointError
from waypoint.lazy import spec_of
from waypoint.models.extra_state import EXTRA_STATE_SUFFIX

EXTRA_STATE_FILE = "extra_state.pt"
_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor)


def is_extra_state_key(key: str) -> bool:
    return key == EXTRA_STATE_SUFFIX or key.endswith("." + EXTRA_STATE_SUFFIX)


def split_extra_state(state: Mapping[str, Any]) -> tuple[Mapping[str, torch.Tensor], dict[str, Any]]:
    """(tensors, extra state) of a native state dict; the extra state is checked to be plain data.

    Only the extra state's values are read: a lazy ``state`` (a sharded model's gathered view) stays lazy.
    """
    extra = {key: state[key] for key in state if is_extra_state_key(key)}
    for key, value in extra.items():
        _check_plain(value, key)
    return (_Without(state, extra.keys()) if extra else state), extra


class _Without(Mapping):
    """``state`` less some keys, reading nothing until asked."""

    def __init__(self, state: Mapping[str, Any], dropped) -> None:
        self._state, self._dropped = state, set(dropped)

    def __getitem__(self, key: str) -> Any:
        if key in self._dropped:
            raise KeyError(key)
        return self._state[key]

    def __iter__(self):
        return (k for k in self._state if k not in self._dropped)

    def __len__(self) -> int:
        return len(self._state) - len(self._dropped)

    def spec(self, key: str):
        return spec_of(self._state, key)


def _check_plain(value: Any, key: str) -> None:
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, key)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            _check_plain(k, key)
            _check_plain(item, key)
        return
    raise CheckpointError(f"{key}: extra state holds a {type(value).__name__}; only tensors and plain Python data "
                          "(None, numbers, strings, lists, dicts) load with weights_only=True")


def load_extra_state(path) -> dict[str, Any]:
    from waypoint.checkpointers.file_formats import load_pickle

    state = load_pickle(path, mmap=False)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not module extra state (a {type(state).__name__})")
    return state
