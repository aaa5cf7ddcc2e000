"""The reference log-probs of a preference run: computed once, kept with the run, reused on resume.

Before its first step a preference run computes the reference model's summed completion log-probs of every
training and validation pair (``waypoint.training.preference_step.reference_pass``) and commits them as
``output_dir/reference/`` (``reference_logps.safetensors`` under its own ``MANIFEST.json``): a run killed during
the pass left only a staging directory, one killed after it reuses the table instead of computing it again. Every
step checkpoint holds a copy in its ``recipe_state.pt`` (8 bytes a pair), hashed into the step's manifest, so a
resume (on another machine too, from an object store) reads the table from the step it continues, verified with
it. Not a file of its own there: a step directory holds the input's files and no other tensor file, which tools
that load every ``*.safetensors`` of a directory without an index (vLLM, for a single-file model) would take for
weights.

A table is tied to what it was computed from by a fingerprint: the pairs' token ids (data, template and
truncation), the input model's files and the dtype. A resume whose inputs give another fingerprint is refused in
one line. The input's weight files are fingerprinted by name, size and their first and last 64 KiB (safetensors
headers and tensor bytes): another model, or the same one re-downloaded at another revision, differs there
without reading gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from waypoint.checkpointers.commit import StagedDir, verify
from waypoint.errors import CheckpointError
from waypoint.run.step_dirs import process_alive

REFERENCE_FILE = "reference_logps.safetensors"
REFERENCE_DIR = "reference"
FORMAT_KEY, FORMAT_VERSION = "waypoint.reference_logps", "1"  # metadata: "<version> <fingerprint>"
SAMPLE = 64 * 1024
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


@dataclass
class ReferenceLogps:
    """The reference's (chosen, rejected) log-probs of each training pair [pairs, 2] and validation pair (or None),
    and the fingerprint of what they were computed from."""

    train: torch.Tensor
    validation: torch.Tensor | None
    fingerprint: str

    def to_bytes(self) -> bytes:
        tensors = {"train": self.train.contiguous()}
        if self.validation is not None:
            tensors["validation"] = self.validation.contiguous()
        # one metadata key: safetensors writes several in no fixed order, and the copies of a table are byte for byte
        return save(tensors, metadata={FORMAT_KEY: f"{FORMAT_VERSION} {self.fingerprint}"})

    def as_state(self) -> dict:
        """What a step's ``recipe_state.pt`` keeps of the table (plain tensors and a string: ``weights_only``)."""
        return {"train": self.train, "validation": self.validation, "fingerprint": self.fingerprint}

    def write(self, stage: StagedDir) -> None:
        data = self.to_bytes()
        stage.write(REFERENCE_FILE, lambda f: f.write(data))

    @classmethod
    def read(cls, path: Path) -> ReferenceLogps:
        """The table in ``path`` (a ``reference_logps.safetensors``), or one line saying why not."""
        try:
            data = path.read_bytes()
            tensors = load(data)
            metadata = _metadata(data)
        except (OSError, SafetensorError, ValueError, struct.error) as e:
            raise CheckpointError(f"{path}: unreadable reference log-probs ({e})") from None
        version, _, fingerprint = metadata.get(FORMAT_KEY, "").partition(" ")
        if version != FORMAT_VERSION or "train" not in tensors:
            raise CheckpointError(f"{path}: not a waypoint reference log-probs file (version {FORMAT_VERSION})")
        return cls(tensors["train"], tensors.get("validation"), fingerprint)


def _metadata(data: bytes) -> dict:
    """A safetensors file's ``__metadata__`` (its header is 8 bytes of length, then JSON)."""
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + size]).get("__metadata__", {})


def input_digest(checkpoint_dir: str | Path) -> str:
    """A fingerprint of the model files in ``checkpoint_dir``: each weight file's name, size, first and last 64 KiB,
    and ``config.json`` / ``params.json`` whole."""
    directory = Path(checkpoint_dir)
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        if path.name in ("config.json", "params.json"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        elif path.suffix in WEIGHT_SUFFIXES:
            size = path.stat().st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            with open(path, "rb") as f:
                digest.update(f.read(SAMPLE))
                f.seek(max(size - SAMPLE, 0))
                digest.update(f.read(SAMPLE))
    return digest.hexdigest()


def reference_fingerprint(parts: Iterable[str]) -> str:
    """One fingerprint of its ``parts`` (digests and settings, in order)."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def resumed_reference(checkpoint: Path, recipe_state: dict, fingerprint: str) -> ReferenceLogps:
    """The table in the ``recipe_state`` of the step ``checkpoint`` a run resumes from (verified with it), if it was
    computed from what this run computes with; else one line."""
    saved = recipe_state.get("reference_logps")
    if not isinstance(saved, dict) or not isinstance(saved.get("train"), torch.Tensor):
        raise CheckpointError(f"cannot resume from {checkpoint}: it holds no reference log-probs (a reference-free "
                              "run's, e.g. loss.type=simpo, or not a preference run's); restore loss.type, or start a new "
                              "run with another output_dir")
    if saved.get("fingerprint") != fingerprint:
        raise CheckpointError(f"cannot resume from {checkpoint}: its reference log-probs were computed from other data, "
                              "model or template than this run's (the dataset file, chat template, truncation, input "
                              "model or dtype changed); restore them, or start a new run with another output_dir")
    return ReferenceLogps(saved["train"], saved.get("validation"), fingerprint)


def earlier_reference(output_dir: Path, fingerprint: str) -> ReferenceLogps | None:
    """The table an earlier attempt of this run committed before its first checkpoint, when it verifies and was
    computed from the same inputs; else None (it is computed again)."""
    directory = output_dir / REFERENCE_DIR
    if not directory.is_dir() or not verify(directory).ok:
        return None
    try:
        table = ReferenceLogps.read(directory / REFERENCE_FILE)
    except CheckpointError:
        return None
    return table if table.fingerprint == fingerprint else None


def commit_reference(output_dir: Path, table: ReferenceLogps) -> Path:
    """``output_dir/reference/``, committed with its manifest (replacing one computed from other inputs)."""
    target = output_dir / REFERENCE_DIR
    if target.exists():
        shutil.rmtree(target)
    with StagedDir(target) as stage:
        table.write(stage)
    return target


def remove_stale_reference(output_dir: Path) -> None:
    """The staging directories of reference passes that were killed (their process is gone)."""
    for path in output_dir.glob(f".{REFERENCE_DIR}.tmp-*") if output_dir.is_dir() else []:
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def obtain_reference(output_dir: Path, checkpoint: Path | None, recipe_state: dict | None, fingerprint: str,
                     compute: Callable[[], tuple[torch.Tensor, torch.Tensor | None]], dist,
                     say: Callable[[str], None]) -> ReferenceLogps:
    """The run's table: the resumed step's (``recipe_state``: its state), or an earlier attempt's ``output_dir/reference/`` computed from the same
    inputs, or ``compute()``'s (train, validation) committed there now. Rank 0 reads and writes; every rank gets
    the table. ``dist``: a ``waypoint.training.distributed.Distributed``."""
    if checkpoint is not None:
        return resumed_reference(checkpoint, recipe_state, fingerprint)  # every rank has read the step's state
    earlier = dist.run_on_main(lambda: earlier_reference(output_dir, fingerprint))
    if earlier is not None:
        say(f"reference log-probs: {output_dir / REFERENCE_DIR} (computed by an earlier attempt from the same inputs)")
        return earlier
    dist.run_on_main(lambda: remove_stale_reference(output_dir))
    started = time.perf_counter()
    train, validation = compute()
    table = ReferenceLogps(train, validation, fingerprint)
    dist.run_on_main(lambda: commit_reference(output_dir, table))
    pairs = len(train) + (len(validation) if validation is not None else 0)
    say(f"reference log-probs of {pairs} pairs computed in {time.perf_counter() - started:.1f} s, kept in "
        f"{output_dir / REFERENCE_DIR} and in every checkpoint: no reference forward during training")
    return table
