"""Step directories written by every rank together, committed once by rank 0.

``ShardedSaver.save`` stages ``step_N`` (rank 0 creates the hidden directory and tells
the others its name), every rank writes its DCP shards into ``sharded/`` there (on its own machine's disk), rank 0 adds
``recipe_state.pt``, the extra state and, for a final checkpoint, the model in the
input's format gathered file by file; each rank hashes the files it wrote, rank 0
gathers the hashes, writes the manifest and renames the directory into place. A kill at
any moment leaves a hidden directory that the next run removes, never a ``step_N``
that is half there.

With ``asynchronous`` the shards are copied to CPU memory and written by DCP in the
background while training continues; at most one save is in flight (the next one, and
the end of training, wait for it), and the time training was blocked is reported.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from waypoint.checkpointers.commit import StagedDir, hash_file
from waypoint.checkpointers.sharded_checkpoint import DCP_ERRORS, SHARDED_DIR, describe_error, rank_files, save_sharded
from waypoint.errors import CheckpointError
from waypoint.run.output_dir import RunDir
from waypoint.run.savers import SaveOptions, StepContent, StepSaver, after_commit

class ShardedSaver(StepSaver):
    """Saves of a multi-process run (``StepSaver``'s arguments)."""

    def __init__(self, dist, run_dir: RunDir | str | Path, options: SaveOptions = SaveOptions(),
                 report: Callable[[str], None] = print) -> None:
        super().__init__(dist, run_dir, options, report)
        self.asynchronous = options.asynchronous
        self._pending: Future | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sharded-save")

    def save(self, step: int, content: StepContent, final: bool = False) -> Path:
        """Stage and commit ``output_dir/step_{step}``; every rank calls this with its own ``content.sharded``;
        rank 0 writes ``content.state`` (a final save also the model in the input's format, whose gathers the
        other ranks serve meanwhile: ``content.serve``). A final save is never asynchronous."""
        started = time.perf_counter()
        self.wait()
        target = self.output_dir / f"step_{step}"
        stage = None

        def open_stage() -> str:
            nonlocal stage
            if self.publish is not None:
                self.publish.prepare(target.name)
            stage = StagedDir(target).open()
            return stage.path.name

        path = self.output_dir / self.dist.run_on_main(open_stage)  # each machine's own output_dir (a mirror's path
        # differs between machines whose caches do)
        asynchronous = self.asynchronous and not final
        try:
            writing = save_sharded(content.sharded or {}, path / SHARDED_DIR, group=self.dist.checkpoint_group,
                                   asynchronous=asynchronous)
        except DCP_ERRORS as e:  # DCP fails on every rank together
            if stage is not None:
                stage.discard()
            raise CheckpointError(f"could not write {target}: {describe_error(e)}; earlier checkpoints are intact") from e
        problem = None
        if stage is not None:  # rank 0's part; the others only serve the export's gathers
            try:
                content.writer(content.state)(stage)
            except Exception as e:  # reported to every rank below, so none is left waiting
                problem = f"could not write {target}: {describe_error(e)}"
        elif content.serve is not None:
            content.serve()
        problem = self.dist.broadcast(problem)
        if problem is not None:  # every rank stops here, nothing committed
            if writing is not None:
                writing.exception()
            if stage is not None:
                stage.discard()
            raise CheckpointError(problem + "; earlier checkpoints are intact")
        if asynchronous:
            self._pending = self._executor.submit(self._finish, stage, path, target, writing)
        else:
            self._finish(stage, path, target, writing)
        blocked = time.perf_counter() - started
        self.blocked_s += blocked
        if self.dist.is_main:
            self.report(f"saving {target.name} in the background; training blocked {blocked:.2f} s" if asynchronous
                        else f"saved {target} in {blocked:.2f} s")
        return target

    def _finish(self, stage: StagedDir | None, path: Path, target: Path, writing: Future | None) -> Path:
        """Runs on every rank (in the background thread for an asynchronous save): wait for the shards,
        hash what this rank wrote, and let rank 0 commit; every rank learns how it went."""
        problem = None
        try:
            if writing is not None:
                writing.result()
            mine = {f"{SHARDED_DIR}/{p.name}": hash_file(p) for p in rank_files(path / SHARDED_DIR, self.dist.rank)}
            if self.publish is not None:  # each rank uploads its own shards, from its own machine
                self.publish.send(path, target.name, list(mine))
        except DCP_ERRORS + (CheckpointError,) as e:  # DCP fails on every rank together; hashing or sending, this rank
            mine, problem = None, str(e) if isinstance(e, CheckpointError) else describe_error(e)
        everyone = self.dist.gather((mine, problem), group=self.dist.checkpoint_group) or []
        if stage is not None:
            problems = [p for _, p in everyone if p]
            if problems:
                stage.discard()
                problem = f"could not write {target}: {problems[0]}"
            else:
                try:
                    for hashes, _ in everyone:
                        for name, (size, digest) in hashes.items():
                            stage.adopt(name, size, digest)
                    stage.commit()
                except Exception as e:  # commit() has removed the staged directory
                    problem = f"could not write {target}: {describe_error(e)}"
                else:
                    try:
                        after_commit(self, target, sent=frozenset(n for hashes, _ in everyone for n in hashes))
                    except CheckpointError as e:
                        problem = str(e)
        problem = self.dist.broadcast(problem, group=self.dist.checkpoint_group)
        if stage is None and self.publish is not None and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)  # this machine's part of a step uploaded from several machines
        if problem is not None:
            raise CheckpointError(problem + "; earlier checkpoints are intact")
        return target

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; its errors are raised here."""
        if self._pending is None:
            return None
        started = time.perf_counter()
        pending, self._pending = self._pending, None
        target = pending.result()  # a failed save raises its CheckpointError here
        waited = time.perf_counter() - started
        self.blocked_s += waited
        if self.dist.is_main:
            self.report(f"saved {target} (training waited {waited:.2f} s for it)")
        return target

    def check(self) -> None:
        pass  # DCP's background write fails on every rank together: wait() raises it at the next save

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
