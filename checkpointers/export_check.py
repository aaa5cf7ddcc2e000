"""Every export read back: the written files go through a checkpointer into a fresh model, which must compute
what the model they were written from computes.

Exports that write cleanly and load as a broken model (a tied head, a RoPE permutation, a prefix, an expert
layout gone wrong) are the failure this catches. The check runs on the staged directory, before it is committed:
a mismatch is a one-line error and nothing is committed.

    check = ExportCheck(model)                      # the probe's logits from the model being written
    checkpointer.save_to(state, target, check=check)  # check(staged_dir) reloads it and compares
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import nn

from waypoint.errors import CheckpointError
from waypoint.models.moe import same_routing

log = logging.getLogger(__name__)
PROBE_SHAPE = (2, 64)  # batch x tokens
# max |logit difference| allowed, by the compute dtype, relative to max |logit| (at least 1): the same weights
# in another layout compute the same logits to rounding; fp32 is exact to 1e-5, half precisions to a few
# units of their rounding (bf16: 8 bits of mantissa) over a model's layers
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# past this (relative to max |logit|, at least 1) a quantized output's own rounding is more than a bf16 model's: the
# run's last line says so
QUANTIZATION_BOUND = 2e-2


def probe_tokens(vocab_size: int, shape: tuple[int, int] = PROBE_SHAPE, seed: int = 0) -> torch.Tensor:
    """A fixed batch of token ids (its own generator: the run's random state is not touched)."""
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def probe_device(model: nn.Module, trained_on: torch.device, free_bytes: int | None = None) -> torch.device:
    """Where the reloaded ``model`` computes its probe: on ``trained_on``, the device the probe's reference came from,
    when it fits there beside what that device already holds (``free_bytes``: its free memory, by default asked of
    CUDA), so that both sides run the same kernels and a difference is the layout's; else on the CPU. Half-precision
    logits differ between a GPU's kernels and the CPU's by the model's own rounding, which a model can amplify past
    the tolerance (tiny random Gemma 4 in bf16: 0.22 at a logit scale of 3.7, on an H200)."""
    cpu = torch.device("cpu")
    if trained_on.type == "cpu":
        return cpu
    if free_bytes is None:
        if trained_on.type != "cuda" or not torch.cuda.is_available():
            return cpu
        free_bytes = torch.cuda.mem_get_info(trained_on)[0]
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return trained_on if weights * 5 // 4 + (256 << 20) <= free_bytes else cpu  # its weights and the probe's activations


def probe_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``model``'s fp32 logits for ``tokens`` in eval mode (no dropout), its mode restored after."""
    training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        with torch.no_grad():
            return model(tokens.to(device)).float().cpu()
    finally:
        model.train(training)


class ExportCheck:
    """``check(directory)``: load ``directory`` (any format) into a fresh model and compare its probe logits with
    those of ``model``, taken now. ``reload(directory)`` builds that model (a recipe's: its config's model class,
    filled through its checkpointer); by default the model the directory's own files describe. Raises a one-line CheckpointError on a mismatch; ``self.line`` says what was
    found (``export verified: max |dlogit| 3.1e-07 over 2x64 tokens (0.4 s)``)."""

    def __init__(self, model: nn.Module, shape: tuple[int, int] = PROBE_SHAPE,
                 report: Callable[[str], None] | None = None, reload: Callable[[Path], nn.Module] | None = None,
                 written: Callable[[nn.Module], AbstractContextManager] | None = None, merged: bool = False,
                 warn: Callable[[str], None] | None = None) -> None:
        self.report = report
        # ``merged``: ``model`` computes with its LoRA adapters beside the weights, the export holds W + s * B @ A,
        # each weight rounded once more; with large adapters on every linear the fp32 logits then differ by about 1e-5
        # of their scale (measured 1.4e-5: tiny model, 7 targets at rank 16, lr 3e-2), so fp32 gets 1e-4
        self.merged = merged
        self.reload = reload  # directory -> a fresh model holding its weights (default: load_model, from its own files)
        self.tokens = probe_tokens(model.args.vocab_size, (shape[0], min(shape[1], model.args.max_seq_len)))
        # ``written(model)``: within it the model holds what the files will (a re-quantized output: the checkpointer's
        # ``as_written``), so the check compares the layout, not the format's rounding; the rounding itself is measured
        # against the model as it trained (``trained``), reported, and past the bound handed to ``warn``
        # the experts each MoE layer chose, replayed in the reloaded model (``models.moe.same_routing``)
        self.trained = probe_logits(model, self.tokens) if written is not None else None
        self.warn = warn
        with (written or nullcontext)(model), same_routing(model) as self.routes:
            self.expected = probe_logits(model, self.tokens)
        self.rounding: float | None = None  # max |dlogit| between the files as written and the model that trained
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.device = next(model.parameters()).device
        self.line = ""
        self.max_diff: float | None = None

    def _merge_rounding(self) -> float:
        """How far a merged export may move the logits (of their scale) from the model with its adapters beside the
        weights: in fp32 1e-4 (above); in half precision each merged weight is rounded once more, which a model of
        Gated DeltaNet layers amplifies to 5-6% of the logits' scale (tiny Qwen3.5 in bf16: 0.16-0.22 at a scale of
        3.5; its bf16 logits differ from its fp32 ones by as much), so 1e-1: still far below a wrong layout's (a
        permuted or misplaced weight moves them by about their whole scale)."""
        if not self.merged:
            return 0.0
        return 1e-1 if self.dtype in (torch.bfloat16, torch.float16) else 1e-4

    def __call__(self, directory: str | Path) -> float:
        from waypoint.checkpointers.load_model import load_model

        started = time.perf_counter()
        logging.disable(logging.INFO)  # the reload's own load report is not the run's
        try:
            model = (self.reload or load_model)(Path(directory))
        finally:
            logging.disable(logging.NOTSET)
        from waypoint.checkpointers.load_model import refresh_derived

        written = next(p.dtype for p in model.parameters() if p.is_floating_point())
        if self.dtype in (torch.bfloat16, torch.float16) and written.itemsize > self.dtype.itemsize:
            # a half-precision model written wider (the input's fp32 files): its values cast back exactly, so the
            # reloaded model computes in the same precision, and any difference is the layout's, not the dtype's
            model = model.to(self.dtype)
            written = self.dtype
        device = probe_device(model, self.device)
        model = model.to(device)
        # the rotary tables computed again in the model's dtype and on its device, as the trained model's were (a
        # GPU's cos/sin differ from the CPU's in the last bit, which a half-precision model can amplify)
        refresh_derived(model)
        with same_routing(model, self.routes):
            got = probe_logits(model, self.tokens)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the reloaded copy's memory back to the run
        across = "" if device == self.device else f"; compared across devices ({self.device.type} and {device.type})"
        diff = (got - self.expected).abs().max().item()
        scale = max(1.0, self.expected.abs().max().item())
        # the coarser of the two dtypes: an export in bf16 of an fp32 model differs by bf16's rounding
        tolerance = max(TOLERANCE.get(self.dtype, 2e-2), TOLERANCE.get(written, 2e-2), self._merge_rounding()) * scale
        batch, length = self.tokens.shape
        if not diff <= tolerance:  # nan fails too
            raise CheckpointError(f"the export does not compute what was written: reloaded, its logits differ by up to "
                                  f"{diff:.3g} (tolerance {tolerance:.3g}) over {batch}x{length} tokens{across}; nothing was "
                                  "committed (this is a bug in the format's converter: please report it)")
        self.max_diff = diff
        self.line = f"export verified: max |dlogit| {diff:.3g} over {batch}x{length} tokens ({time.perf_counter() - started:.2f} s)"
        if self.trained is not None:
            self.rounding = (self.expected - self.trained).abs().max().item()
            self.line += f"; the output's quantization moves the logits up to {self.rounding:.3g} from the model that trained"
            if not self.rounding <= QUANTIZATION_BOUND * scale and self.warn is not None:
                self.warn(f"the quantized output differs from the model that trained by up to {self.rounding:.3g} in the "
                          "logits (its changed tensors re-quantized to the input's format); output_quantization: none "
                          "writes the trained weights unquantized")
        log.info(self.line)
        if self.report is not None:
            self.report(self.line)
        return diff
