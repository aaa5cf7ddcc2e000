"""Conversions that keep every outside reference to a parameter valid.

``swapping_conversions()`` turns on ``torch.__future__.set_swap_module_params_on_conversion``: then
``load_state_dict`` (also with ``assign=True``) and ``.to()`` / ``.float()`` / ``to_empty`` put the new tensor
into the existing ``Parameter`` object with ``torch.utils.swap_tensors`` (class, ``__dict__`` and data),
instead of replacing the object or its ``.data``. An optimizer, a hook or FSDP2, built before such a
conversion, keeps updating the parameter the model really uses; a replaced object would be trained in the
optimizer and never seen by the model. It is also the only way a parameter can change class in place (a
meta placeholder becoming an NF4 weight).
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

import torch


@contextmanager
def swapping_conversions(enabled: bool = True) -> Iterator[None]:
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(enabled)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
