"""Non-tensor (or lazily created) module state that belongs in checkpoints.

PyTorch saves a module's ``get_extra_state()`` under ``<prefix>_extra_state`` and
hands it back to ``set_extra_state()`` on load. :class:`ExtraStateModule` does
both for the attributes a module names in ``extra_state_attributes``, and
registers a load pre-hook so that a checkpoint written before the module had
extra state still loads: the attributes keep their defaults, and the log says so.

    class Calibration(ExtraStateModule):
        extra_state_attributes = ("scale",)   # None until the first training step sets it
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)
EXTRA_STATE_SUFFIX = "_extra_state"


def _supply_missing_extra_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    key = prefix + EXTRA_STATE_SUFFIX
    if key not in state_dict:
        log.warning("checkpoint has no %s (written before this module had extra state); keeping %s as they are",
                    key, ", ".join(module.extra_state_attributes))
        state_dict[key] = {}


class ExtraStateModule(nn.Module):
    """An ``nn.Module`` whose ``extra_state_attributes`` are saved and restored with its state dict.

    The values must be tensors or plain Python data (None, numbers, strings, lists,
    dicts), so that checkpoints stay loadable with ``torch.load(weights_only=True)``.
    """

    extra_state_attributes: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_pre_hook(_supply_missing_extra_state)

    def get_extra_state(self) -> dict:
        return {name: getattr(self, name) for name in self.extra_state_attributes}

    def set_extra_state(self, state: dict) -> None:
        for name in self.extra_state_attributes:
            if name in state:
                setattr(self, name, state[name])
