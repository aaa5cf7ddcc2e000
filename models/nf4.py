"""QLoRA's 4-bit base: frozen linear weights held as torchao's ``NF4Tensor``, quantized one tensor at a time
while a checkpoint loads, so the full-precision model never exists in memory.

Three PyTorch extension points, each where it belongs (see the PyTorch recipe "Extension points in nn.Module
for load_state_dict and tensor subclasses"):

- **the placeholder** (:func:`quantize_linears`): on the meta-built model each frozen base linear's weight
  becomes a *meta* ``NF4Tensor`` (shape, compute dtype, block sizes; no data). Being the parameter's class
  is what lets the weight decide how it is loaded, and FSDP2 shards it like any parameter (NF4Tensor
  implements the chunk / pad ops and ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).
- **module_load** (:func:`_nf4_module_load`, registered in torchao's own table of NF4 torch functions):
  with swapping on, ``load_state_dict`` asks the *destination* parameter how to take the incoming
  tensor (``param.module_load(src, assign)``). An NF4 weight's answer is to quantize ``src`` with its own
  block sizes, so the checkpoint's tensor is converted as it is read and only the 4-bit copy is kept.
  torchao leaves this undefined (the default would assign the bf16 tensor, or quantize into the meta
  placeholder's nonexistent buffers).
- **swap_tensors** (``torch.__future__.set_swap_module_params_on_conversion(True)``, turned on for a
  recipe's run by ``waypoint.cli.entry``): ``load_state_dict`` and ``.to()``-style conversions swap
  the new tensor into the existing ``Parameter`` object instead of replacing it. A parameter cannot change
  class through ``.data`` (meta placeholder -> NF4 data, bf16 -> NF4), and replacing the object would
  leave an optimizer or hook holding the old one.

Embeddings, norms, biases and the output head stay in the compute dtype (the head is quantized on request
unless it is tied to the embedding); MoE experts, stacked 3-D parameters, stay too (NF4Tensor is 2-D). A
weight whose size does not divide into NF4 blocks stays in the compute dtype and is reported.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from waypoint.models.vision_towers import IMAGE_SIDE

# the frozen base linears of every block (Gated DeltaNet's big three too: its per-head in_proj_b / in_proj_a stay)
LINEARS = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3", "in_proj_qkv", "in_proj_z", "out_proj")
QUANTIZE_BASE = ("nf4", "mxfp4", "fp8")  # what quantize_base accepts (null: the base in the compute dtype); mxfp4: models/mxfp4_weight.py, fp8: models/fp8_weight.py
_registered = False


def nf4_tensor_class() -> type:
    """torchao's NF4Tensor, imported on first use with torchao's import-time chatter (CUDA kernels it could
    not load, which NF4 does not use) kept out of the user's terminal; registers the NF4 ``module_load``."""
    global _registered
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        try:
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, implements_torch_function
        except ImportError:  # torchao < 0.15
            from torchao.dtypes.nf4tensor import NF4Tensor, implements_torch_function
    except ImportError as e:
        raise ImportError("quantize_base: nf4 needs torchao: pip install torchao") from e
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    if not _registered:
        implements_torch_function(torch.Tensor.module_load)(_nf4_module_load)
        _registered = True
    return NF4Tensor


def _nf4_module_load(dest: torch.Tensor, src: torch.Tensor, assign: bool = False) -> torch.Tensor:
    """``NF4Tensor.module_load``: how ``load_state_dict`` puts ``src`` into the NF4 parameter ``dest``. A
    full-precision ``src`` is quantized with ``dest``'s block sizes in ``dest``'s dtype, on ``src``'s device
    (the loader moves it first, so a GPU quantizes on the GPU); an NF4 ``src`` is taken as it is (assign) or
    copied into ``dest``'s buffers. Returns a new tensor, never ``dest`` or ``src``, as the contract asks."""
    NF4Tensor = type(dest)
    if not isinstance(src, NF4Tensor):
        src = NF4Tensor.from_tensor(src.detach().to(dest.dtype).contiguous(), dest.block_size, dest.scaler_block_size)
    if assign or dest.is_meta:
        return src.detach()
    dest.copy_(src)  # into dest's own buffers (torchao's copy_ re-quantizes an NF4 of other blocks); returns None
    return dest.detach()


def is_nf4(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the local piece of a sharded ``t``) is an NF4Tensor; by name, so that asking (every load
    does, for every tensor) never imports torchao."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return type(local).__name__ == "NF4Tensor" and hasattr(local, "quantized_data")


def nf4_nbytes(t: torch.Tensor) -> int:
    """The bytes an NF4 tensor holds (packed 4-bit data and its double-quantized scalers)."""
    inner, _ = t.__tensor_flatten__()
    return sum(getattr(t, name).numel() * getattr(t, name).element_size() for name in inner)


def block_problem(shape: torch.Size, block_size: int, scaler_block_size: int, shards: int = 1) -> str | None:
    """Why a weight of ``shape`` cannot be held in NF4 (None: it can). NF4 quantizes blocks of ``block_size``
    values with one scale each, and those scales in blocks of ``scaler_block_size``; FSDP2 cuts rows, scales
    and data into ``shards`` equal pieces."""
    numel = shape.numel()
    if len(shape) != 2:
        return f"{len(shape)}-D (NF4 holds 2-D weights)"
    if numel % block_size:
        return f"{numel} values do not divide into blocks of {block_size}"
    if (numel // block_size) % scaler_block_size:
        return f"its {numel // block_size} blocks do not divide into scaler blocks of {scaler_block_size}"
    if shards > 1 and (shape[0] % shards or (numel // block_size // scaler_block_size) % shards):
        return f"its rows and scaler blocks do not divide among {shards} processes"
    return None


@dataclass
class QuantizedBase:
    """What :func:`quantize_linears` did: the weights now NF4, and those kept in the compute dtype with why."""

    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


def quantize_linears(model: nn.Module, dtype: torch.dtype, block_size: int = 64, scaler_block_size: int = 256,
                     include_output: bool = False, shards: int = 1) -> QuantizedBase:
    """Make every frozen base linear weight of a model (built on the meta device, before loading) an NF4
    placeholder in ``dtype``; a loaded weight is quantized at once. ``shards``: the FSDP2 world size the
    weights will be cut into. Returns what was quantized and what was kept, and why."""
    NF4Tensor = nf4_tensor_class()
    names = LINEARS + (("output",) if include_output else ())
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    result = QuantizedBase()
    for name, module in model.named_modules():
        weight, leaf = getattr(module, "weight", None), name.rpartition(".")[2]
        if leaf not in names or not isinstance(weight, torch.Tensor) or is_nf4(weight) or name.startswith(IMAGE_SIDE):
            continue  # a vision-language model's tower stays in dtype, as it came
        key = f"{name}.weight"
        if leaf == "output" and tied:
            result.kept[key] = "tied to the embedding"
            continue
        problem = block_problem(weight.shape, block_size, scaler_block_size, shards)
        if problem:
            result.kept[key] = problem
            continue
        if weight.is_meta:
            held = nf4_placeholder(weight.shape, dtype, block_size, scaler_block_size)
        else:
            held = NF4Tensor.from_tensor(weight.detach().to(dtype).contiguous(), block_size, scaler_block_size)
        module.weight = nn.Parameter(held, requires_grad=False)
        result.quantized.append(key)
    return result


def nf4_placeholder(shape: torch.Size, dtype: torch.dtype, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """A meta-device NF4Tensor of ``shape``: the inner tensors ``NF4Tensor.from_tensor`` would make, without data
    (running the quantizer on the meta device costs about 2 s for an 8B model's linears)."""
    NF4Tensor = nf4_tensor_class()
    numel, n_blocks = shape.numel(), shape.numel() // block_size
    meta = torch.empty(shape, dtype=dtype, device="meta")
    args = sys.modules[NF4Tensor.__module__].SubclassTensorArgs(meta.size(), meta.stride(), 0, dtype, meta.device, False)
    return NF4Tensor(args, block_size, n_blocks, scaler_block_size,
                     torch.empty(n_blocks, dtype=torch.int8, device="meta"),  # quantized_scalers
                     torch.empty(n_blocks // scaler_block_size, dtype=dtype, device="meta"),  # quantization_factor
                     torch.empty((), dtype=dtype, device="meta"),  # scaler_mean
                     torch.empty(numel // 2, dtype=torch.uint8, device="meta"),  # quantized_data: two values a byte
                     torch.empty(16, dtype=dtype, device="meta"))  # nf4: the 16 levels


def nf4_local_shard(full: torch.Tensor, like: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """This rank's piece of ``full`` for a sharded NF4 parameter laid out as ``like`` (FSDP2: rows split evenly
    over a 1-D mesh). The whole tensor is quantized first, on ``device``, so every piece carries the scales one
    process would compute (and an all-gather rebuilds exactly the single-process weight); then it is cut."""
    from torch.distributed.tensor import DTensor, Shard

    NF4Tensor = nf4_tensor_class()
    mesh, placements, local = like.device_mesh, tuple(like.placements), like.to_local()
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"an NF4 weight can be sharded by rows over one mesh dimension, not {placements}")
    whole = NF4Tensor.from_tensor(full.to(device=device, dtype=like.dtype).contiguous(), local.block_size,
                                  local.scaler_block_size)
    piece = torch.chunk(whole, mesh.size(0), dim=0)[mesh.get_local_rank(0)]
    return DTensor.from_local(piece, mesh, placements, run_check=False, shape=full.shape,
                              stride=torch.empty(full.shape, device="meta").stride())
