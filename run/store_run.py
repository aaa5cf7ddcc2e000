"""A run whose ``output_dir`` is an object-store URL (``s3://bucket/prefix``).

The run works in a local mirror of the prefix (``$WAYPOINT_CACHE/runs/s3/bucket/prefix``, default cache
``~/.cache/waypoint``): each step is written and committed there as on any disk, then uploaded, manifest last
(``waypoint.run.object_store``); under torchrun each rank uploads the shards it wrote from its own machine's
mirror, so machines need no shared disk. The store is the truth: at start every machine's mirror drops any step
the store has not committed, and the newest committed step is downloaded (and its hashes verified) where a mirror
lacks it, so a rerun on other machines resumes the same way. A committed step broken in the store (objects truncated
or lost) is repaired from rank 0's mirror when its copy there verifies; otherwise it is skipped, with a line saying
how to be rid of it. ``metrics.jsonl`` is uploaded after every step. One run per prefix: the store's lock object
(``waypoint.run.lock.StoreLease``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from waypoint.checkpointers.commit import MANIFEST, verify
from waypoint.errors import CheckpointError, first_line
from waypoint.run.lock import StoreLease
from waypoint.run.metrics import METRICS_FILE
from waypoint.run.object_store import ObjectStore, access_problem, cache_dir, is_url, store_errors
from waypoint.run.output_dir import RunDir
from waypoint.run.step_dirs import step_dirs


def mirror_dir(url: str) -> Path:
    """Where a run on ``url`` works locally."""
    return cache_dir() / "runs" / url.rstrip("/").replace("://", "/", 1)


@contextmanager
def run_dir_for(output_dir: str, dist) -> Iterator[RunDir]:
    """Where the run with this ``output_dir`` works: the directory itself; for an object-store URL its local mirror,
    with the prefix's lock held (rank 0) for the block."""
    if not is_url(output_dir):
        yield RunDir(Path(output_dir))
        return
    store = ObjectStore(output_dir)
    local = mirror_dir(store.url)
    lease = StoreLease(store) if dist.is_main else None

    def take() -> None:
        local.mkdir(parents=True, exist_ok=True)
        with store_errors(store.url, "take the run's lock object"):
            lease.acquire()
    dist.run_on_main(take)
    try:
        yield RunDir(local, store.url)
    finally:
        if lease is not None:
            lease.release()


def sync_mirror(run_dir: RunDir, resume, overwrite: bool, say=print) -> None:
    """Before a run chooses where to start (on each machine): the mirror holds no step that the store has not
    committed, and holds the newest committed one (downloaded and verified); a store holding steps of which none is
    committed is refused unless ``overwrite``, and a fresh run (``resume=false``) on a prefix with committed steps
    always is."""
    with store_errors(run_dir.store, "read its checkpoints"):
        _sync_mirror(ObjectStore(run_dir.store), run_dir.path, resume, overwrite, say)


def _sync_mirror(store: ObjectStore, local: Path, resume, overwrite: bool, say) -> None:
    remote = store.steps()
    for path in step_dirs(local):
        if path.name not in remote or not _same_step(store.manifest(path.name), path):
            shutil.rmtree(path)  # a cached copy of a step the store does not hold committed (or holds another of)
    if not (local / METRICS_FILE).exists():
        store.get(METRICS_FILE, local / METRICS_FILE)
    fresh = resume in (False, "false", "False", "no")
    if fresh and any(store.manifest(n) is not None for n in remote):
        raise CheckpointError(f"output_dir {store.url} already holds checkpoints; resume=auto continues them; an object-store "
                              "output_dir is never overwritten: choose another prefix")
    if fresh or resume not in (True, "auto", "true", "True"):
        return
    for name in remote:
        checked = store.check(name)
        if not checked.ok and (local / name).is_dir() and _repair(store, local / name, checked.problem, say):
            return
        if checked.ok and (local / name).is_dir():
            if verify(local / name, hash_contents=False).ok:
                return
            shutil.rmtree(local / name)  # a cached copy that lost files: fetched again
        if checked.ok:
            checked = store.download(name, local / name)
            if checked.ok:
                say(f"downloaded {store.where(name)} ({checked.files} files, {checked.bytes / 1e9:.2f} GB, hashes verified)")
                return
        unfinished = checked.problem.startswith(f"no {MANIFEST}")  # an upload that did not finish: no checkpoint
        say(f"warning: skipping {store.where(name)}: {checked.problem}" + ("" if unfinished else (
            f"; the store's copy is broken and was not repaired (rank 0's machine holds no verified copy of it): "
            f"delete {store.where(name)} so that no run resumes from it")))
    if remote and not overwrite:
        raise CheckpointError(f"output_dir {store.url} holds checkpoints but none is committed and complete; "
                              "set overwrite=true to start again (what is there is moved aside, never deleted)")


def _same_step(manifest: dict | None, path: Path) -> bool:
    """Whether the local step ``path`` is a copy of the step the store committed with ``manifest``."""
    try:
        return manifest is not None and json.loads((path / MANIFEST).read_text())["files"] == manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _repair(store: ObjectStore, mirrored: Path, problem: str, say) -> bool:
    """A step committed in the store but broken there (``problem``: objects missing or of the wrong size) whose copy
    in this machine's mirror verifies (every hash): the store's step is repaired from it (``ObjectStore.upload`` in
    place: the wrong objects copied aside to ``step_N.broken`` first, the manifest written last). Only rank 0, which
    holds the lock and syncs before the other machines, writes to the store. Whether it was repaired."""
    if int(os.environ.get("RANK", "0")) != 0 or not verify(mirrored).ok:
        return False
    name = mirrored.name
    with store_errors(store.where(name), "repair it from this machine's copy"):
        files, there = json.loads((mirrored / MANIFEST).read_text())["files"], store.sizes(name)
        bad = sorted(f for f, entry in files.items() if there.get(f) != entry["size"])
        wrong = [f for f in bad if f in there]
        aside = store.set_aside(name, "broken", wrong) if wrong else None
        store.upload(mirrored, sent=frozenset(files) - set(bad), replace=True)
    say(f"repaired {store.where(name)} ({problem}): uploaded {len(bad)} file(s) from this machine's verified copy, "
        f"manifest last" + (f"; the broken objects are kept at {store.where(aside)}" if aside else ""))
    return True


class StorePublisher:
    """After each local commit (rank 0): upload the step, manifest last; prune committed steps beyond
    ``keep_last_n``; upload ``metrics.jsonl``. Under torchrun every rank first uploads the shards it wrote
    (``send``), from its own machine's mirror, so no machine needs another's files; rank 0 set the step's
    leftovers aside before (``prepare``) and commits it with the manifest last."""

    def __init__(self, url: str, local: Path, keep_last_n: int | None, report=print) -> None:
        self.store, self.local, self.keep_last_n, self.report = ObjectStore(url), Path(local), keep_last_n, report
        self._started: float | None = None

    def prepare(self, name: str) -> None:
        """Before any rank uploads step ``name``: objects of an earlier attempt are moved aside (``name.partial``)."""
        with self._failures(f"set aside the leftovers of {self.store.where(name)}"):
            if self.store.fs.exists(self.store.path(name)):
                self.store.set_aside(name, "partial")

    def send(self, directory: Path, name: str, files: list[str]) -> None:
        """This rank's own files of step ``name``, staged in ``directory``."""
        self._started = self._started or time.perf_counter()
        with self._failures(f"upload {name} to {self.store.url}"):
            self.store.send(Path(directory), name, files)

    def __call__(self, target: Path, sent: frozenset[str] = frozenset()) -> None:
        started, self._started = self._started or time.perf_counter(), None
        with self._failures(f"upload {target.name} to {self.store.url}", f"; it is committed locally at {target}"):
            total = self.store.upload(target, sent=sent)
            self.store.prune(self.keep_last_n)
            if (self.local / METRICS_FILE).exists():
                self.store.put(self.local / METRICS_FILE, METRICS_FILE)
        seconds = time.perf_counter() - started
        self.report(f"uploaded {self.store.where(target.name)}: {total / 1e6:.1f} MB in {seconds:.2f} s "
                    f"({total / 1e6 / max(seconds, 1e-9):.0f} MB/s)")

    @contextmanager
    def _failures(self, doing: str, where: str = ""):
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            what, to_do = access_problem(e) or (f"{first_line(e)} ({e.__class__.__name__})", "")
            raise CheckpointError(f"could not {doing}: {what}{where}; " + (f"{to_do}; " if to_do else "")
                                  + "the store's earlier checkpoints are intact") from e
