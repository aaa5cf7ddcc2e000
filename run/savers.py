"""One way to save a step: the recipe says what a step checkpoint holds (:class:`StepContent`, built by
``step_content``), a saver writes and commits it. ``WholeStepSaver`` has rank 0 write whole files (a single
process; LoRA's adapters under torchrun), synchronously or, on one process, in the background; ``ShardedSaver``
(``sharded_saver``) has every rank write its DCP shards. Both take the same content, commit ``output_dir/step_N``
the same way and then, once it is committed (:func:`after_commit`), delete what it replaces (an overwritten run's
steps, steps beyond ``keep_last_n``) and hand it to the object store of an object-store run.

An asynchronous save copies the step's tensors into CPU buffers kept from one save to the next (pinned when the
model is on CUDA) at the step boundary, checks what it will write, and leaves writing, hashing and committing to
a background thread while training goes on. At most one save is in flight: the next one waits for it and says
so. A failure in the background is raised by :meth:`check` at the next step, as one line, and nothing of that
save is committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from waypoint.checkpointers.base import write_directory
from waypoint.checkpointers.commit import StagedDir
from waypoint.errors import CheckpointError
from waypoint.run.output_dir import RunDir
from waypoint.run.step_dirs import prune_checkpoints, settle_overwritten
from waypoint.run.store_run import StorePublisher


@dataclass(frozen=True)
class SaveOptions:
    """How a run keeps its step checkpoints: the newest ``keep_last_n`` (None: all), written in the background with
    ``asynchronous`` (``async_checkpoint``)."""

    keep_last_n: int | None = None
    asynchronous: bool = False


@dataclass
class StepContent:
    """What one step checkpoint holds.

    ``state``: what rank 0 writes, nested dicts of tensors and plain values (copied at the step boundary for an
    asynchronous save); ``writer(state)``: checks it and returns the function that writes it into the staged
    directory; ``sharded``: every rank's tensors for DCP's ``sharded/`` (torchrun); ``serve``: what the other
    ranks do while rank 0 writes (serve the gathers of a sharded model's export)."""

    state: Mapping[str, Any]
    writer: Callable[[Mapping[str, Any]], Callable[[StagedDir], None]]
    sharded: Mapping[str, Any] | None = None
    serve: Callable[[], None] | None = None


class Publisher(Protocol):
    """Where committed steps go beyond the local disk (an object store: ``StorePublisher``)."""

    def prepare(self, name: str) -> None:
        """Rank 0, before step ``name`` is written: clear the way (an earlier attempt's leftovers)."""

    def send(self, directory: Path, name: str, files: list[str]) -> None:
        """Every rank of a sharded save: the files it wrote itself, from ``directory`` (its machine's staging)."""

    def __call__(self, target: Path, sent: frozenset[str] = frozenset()) -> None:
        """Rank 0, after the local commit of ``target``: the rest of the step, committed there last."""


class StepSaver:
    """What the recipes call: ``save`` once per due step, ``check`` every step, ``close`` at the end.

    ``run_dir``: where the run lives (a ``RunDir``, or a local path); ``dist``: a
    ``waypoint.training.distributed.Distributed``; ``report``: where rank 0's lines go. An object-store run's
    committed steps are uploaded to its store (``publish``)."""

    def __init__(self, dist, run_dir: RunDir | str | Path, options: SaveOptions = SaveOptions(),
                 report: Callable[[str], None] = print) -> None:
        run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        self.dist, self.output_dir, self.keep_last_n = dist, run_dir.path, options.keep_last_n
        self.report = report if dist.is_main else (lambda line: None)
        self.blocked_s = 0.0  # training time spent in saves, all saves together
        self.publish: Publisher | None = None  # where each committed step goes next (an object store)
        if run_dir.store:
            self.publish = StorePublisher(run_dir.store, run_dir.path, options.keep_last_n, self.report)

    def save(self, step: int, content: StepContent, final: bool = False) -> Path:
        raise NotImplementedError

    def check(self) -> None:
        """Raise the error of a background save that failed (nothing of it was committed)."""

    def close(self) -> None:
        """Wait for the save in flight, if any."""


class CpuStaging:
    """Copies of a step's tensors in CPU buffers that are reused by the next save of the same shapes (pinned when
    the tensors are on CUDA, so the copies are asynchronous DMA), and plain values copied as they are."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._seen: dict[tuple, torch.Tensor] = {}
        self.nbytes = 0  # host memory the buffers hold

    def copy(self, state: Any, path: str = "") -> Any:
        self._seen = {}  # one tensor under two names (tied embeddings) stays one tensor in the copy
        copied = self._copy(state, path)
        from_cuda = any(device.type == "cuda" for device, *_ in self._seen)
        self._seen = {}
        if from_cuda:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return copied

    def _copy(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, Mapping):
            return {k: self._copy(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, f"{path}/{i}") for i, v in enumerate(value))
        return value  # ints, floats, strings, None: immutable

    def _tensor(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type == "meta" or type(tensor) is not torch.Tensor:
            return tensor.clone()  # tensor subclasses (NF4) and placeholders: a plain copy
        view = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tensor.stride(), tensor.dtype)
        if view in self._seen:
            return self._seen[view]
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            if path in self._buffers:
                self.nbytes -= self._buffers[path].nbytes
            self._buffers[path] = buffer
            self.nbytes += buffer.nbytes
        buffer.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        self._seen[view] = buffer
        return buffer


class WholeStepSaver(StepSaver):
    """Rank 0 writes the step's files and commits them; the other ranks run ``content.serve`` meanwhile.
    ``asynchronous`` (one process only): non-final saves are written in the background."""

    def __init__(self, dist, run_dir: RunDir | str | Path, options: SaveOptions = SaveOptions(),
                 report: Callable[[str], None] = print) -> None:
        super().__init__(dist, run_dir, options, report)
        self.asynchronous = options.asynchronous and not dist.enabled
        self._staging = CpuStaging()
        self._pending: Future | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-save") if self.asynchronous else None

    @property
    def staging_bytes(self) -> int:
        """Host memory held for asynchronous saves."""
        return self._staging.nbytes

    def save(self, step: int, content: StepContent, final: bool = False) -> Path:
        """Write and commit ``output_dir/step_{step}``; in the background unless ``final`` (the run's last save, or
        a preemption's, which must be on disk before the process exits)."""
        started = time.perf_counter()
        self.wait()
        target = self.output_dir / f"step_{step}"
        if self.asynchronous and not final:
            write = content.writer(self._staging.copy(content.state))  # checked now, at the step boundary
            self._pending = self._executor.submit(self._write, target, write)
            blocked = time.perf_counter() - started
            self.blocked_s += blocked
            self.report(f"saving {target.name} in the background; training blocked {blocked:.2f} s")
            return target

        def write_now() -> Path:
            return self._write(target, content.writer(content.state))
        saved = self.dist.run_on_main(write_now, others=content.serve)
        blocked = time.perf_counter() - started
        self.blocked_s += blocked
        if self.dist.is_main:
            self.report(f"saved {saved} in {blocked:.2f} s")
        return saved

    def _write(self, target: Path, write: Callable[[StagedDir], None]) -> Path:
        write_directory(target, write)
        after_commit(self, target)
        return target

    def check(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; its error is raised here."""
        if self._pending is None:
            return None
        started, pending = time.perf_counter(), self._pending
        if not pending.done():
            self.report("waiting for the previous checkpoint to finish writing")
        self._pending = None
        try:
            target = pending.result()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"the background checkpoint save failed: {e} ({e.__class__.__name__}); nothing of it "
                                  "was committed and earlier checkpoints are intact") from e
        waited = time.perf_counter() - started
        self.blocked_s += waited
        self.report(f"saved {target}" + (f" (training waited {waited:.2f} s for it)" if waited > 0.01 else ""))
        return target

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)


def after_commit(saver: StepSaver, target: Path, sent: frozenset[str] = frozenset()) -> None:
    """Once ``target`` is committed (rank 0): an overwritten earlier run's steps go (this run has one of its own now),
    and so do the steps beyond the newest ``keep_last_n``; then the step goes to the object store, if any (``sent``:
    its files that every rank already uploaded)."""
    settle_overwritten(saver.output_dir)
    prune_checkpoints(saver.output_dir, saver.keep_last_n)
    if saver.publish is not None:
        saver.publish(target, sent=sent)
