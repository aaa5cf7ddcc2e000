"""What a W&B offline run holds: its history, read from the ``run-<id>.wandb`` files W&B writes and ``wandb sync``
uploads.

Offline, nothing but these files can say which steps a run has (there is no server to ask), and a run killed
while W&B's service still held steps in memory has lost them: a resumed run reads its files
(:func:`last_offline_step`) to send each step once (``waypoint.run.tracker_wandb``). Each file is a LevelDB-style log,
a 7-byte header (``:W&B``, a magic and a version) and then 32 KiB blocks of records, each a 7-byte header (CRC,
length, kind: whole, first, middle or last piece) and a piece of a ``wandb_internal_pb2.Record``. A torn end (a
kill in the middle of a write) ends the reading.

W&B's service keeps the block it is filling in memory and writes it when the block is full or the run's stream
closes, which happens after ``run.finish()`` has returned (the service is told with a message it does not answer):
until then a short run's file holds its 7-byte header alone. :func:`wait_closed` waits for the run's exit record,
the last one it writes.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # the file's header, and each record's
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path, last_blocks: int | None = None) -> Iterator[bytes]:
    """Each whole record of a ``.wandb`` file, in order; with ``last_blocks``, those that end in its last blocks."""
    with open(path, "rb") as file:
        if file.read(4) != b":W&B":
            raise ValueError(f"{path}: not a W&B run file")
        size = file.seek(0, 2)
        start = 0 if last_blocks is None else max(0, (size - 1) // BLOCK + 1 - last_blocks) * BLOCK
        file.seek(start)
        data = file.read()
    # a record that began before `start` has no first piece here: its pieces are skipped
    pos, pieces, whole = (HEADER if start == 0 else 0), b"", False
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zeros: the rest of the block is padding
            pos += left
            continue
        if pos + HEADER + length > len(data) or kind not in (FULL, FIRST, MIDDLE, LAST):
            return  # torn
        piece, pos = data[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        if kind == FULL:
            yield piece
        elif kind == FIRST:
            pieces, whole = piece, True
        elif kind == MIDDLE:
            pieces += piece
        elif whole:
            yield pieces + piece
            pieces, whole = b"", False


def parsed(path: str | Path, last_blocks: int | None = None) -> Iterator[Any]:
    """Each record of a ``.wandb`` file as a ``wandb_internal_pb2.Record`` (``last_blocks``: as :func:`records`)."""
    from wandb.proto import wandb_internal_pb2

    for data in records(path, last_blocks):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        yield record


def history(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(step, {key: value}) for each history row of a ``.wandb`` file (W&B's own ``_step``, ``_runtime``... included)."""
    for record in parsed(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            yield record.history.step.num, row


def run_files(wandb_dir: str | Path, run_id: str) -> list[Path]:
    """A run's offline files under W&B's own folder (``<dir>/wandb``): one per process that logged to it, oldest first."""
    return sorted(Path(wandb_dir).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def last_offline_step(wandb_dir: str | Path, run_id: str, skip: Path | None = None) -> int:
    """The last step of run ``run_id`` in its offline files (0: none), but those of the run directory ``skip``."""
    last = 0
    for path in run_files(wandb_dir, run_id):
        if skip is not None and path.parent == skip:
            continue
        try:
            for step, _ in history(path):
                last = max(last, step)
        except Exception:  # an unreadable record (a damaged file): what came before it is what the run holds
            continue
    return last


def closed(path: str | Path) -> bool:
    """Whether W&B has written all of a run's file: its exit record is there (a small record, in the last two blocks
    whatever the file's size)."""
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in parsed(path, last_blocks=2))
    except (OSError, ValueError):  # not there yet, or not even its header
        return False


def wait_closed(path: str | Path, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Wait at most ``timeout_s`` for W&B to write all of a finished run's file (:func:`closed`)."""
    deadline = time.monotonic() + timeout_s
    while not closed(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
