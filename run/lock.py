"""One run per ``output_dir``: an exclusive lock held for the run's whole life, on a disk (:class:`RunLock`) and in
an object store (:class:`StoreLease`).

The lock is ``fcntl.flock`` on ``output_dir/.waypoint.lock``. The kernel releases it when the
process ends, however it ends (a SIGKILL, a node reboot), so a killed run never blocks its rerun.
The holder writes who it is (host, pid, since when, command) into the file, and a second run that
finds it held refuses in one line naming the holder. A run that ends removes the file (and an
``output_dir`` it created and left empty).

filelock (huggingface_hub's) would do the locking, but it truncates the file when opening it, which
erases the holder's description before the refused run could read it; so this is flock directly.

On NFS (v4, or v3 with lockd) Linux clients turn flock into POSIX byte-range locks, which every
client sees; Lustre sees them only when mounted with ``-o flock`` (``localflock`` locks per node).

In an object store (``s3://bucket/prefix``), the lock is an object ``.waypoint.lock`` created only if absent (S3's
``If-None-Match: *``), holding a lease that the run renews every minute; a lock whose lease ran out, or whose holder
was a process of this host that is gone (a SIGKILL), is taken over. A store that ignores conditional writes leaves
a small window where two runs starting at the same moment both take it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from waypoint.errors import CheckpointError

LOCK_FILE = ".waypoint.lock"
LEASE_S = 600  # a store lock not renewed for this long belongs to a run that is gone
RENEW_S = 60


class RunLock:
    """``with RunLock(output_dir):`` holds ``output_dir`` for this process, or raises a one-line CheckpointError."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> RunLock:
        self._created_dir = not self.output_dir.exists()
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    os.close(fd)
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise CheckpointError(f"output_dir {self.output_dir} is in use by another run ({self._holder()}); "
                                              "wait for it to end, or choose another output_dir") from None
                    raise
                # The previous holder may have removed the file between our open and our lock: then the lock
                # is on a file nobody else can find, and we try again with the file now at the path.
                if _same_file(fd, self.path):
                    break
                os.close(fd)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(_me()).encode())
            os.fsync(fd)
        except OSError as e:
            self._forget_dir()
            raise CheckpointError(f"output_dir {self.output_dir}: cannot create {LOCK_FILE} there "
                                  f"({e.strerror or e}); choose a writable output_dir") from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: a run starting now retries on the new file
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        self._forget_dir()

    def _forget_dir(self) -> None:
        if self._created_dir:
            try:
                self.output_dir.rmdir()  # only when nothing was written into it
            except OSError:
                pass

    def _holder(self) -> str:
        try:
            who = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            who = {}
        if not who:
            return "holder unknown"
        return f"host {who.get('host')}, pid {who.get('pid')}, since {who.get('since')}"

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _me() -> dict:
    """Who holds a lock: this host and process, since when, running what."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": " ".join(sys.argv)[:500]}


class StoreLease:
    """The lock object of an object-store prefix (see the module's docstring); ``store``: its
    ``waypoint.run.object_store.ObjectStore``."""

    def __init__(self, store) -> None:
        self.store, self.path = store, store.path(LOCK_FILE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.me = _me()

    def _body(self) -> bytes:
        return json.dumps(self.me | {"expires": time.time() + LEASE_S}).encode()

    def acquire(self) -> None:
        fs = self.store.fs
        try:
            fs.pipe_file(self.path, self._body(), mode="create")
        except FileExistsError:
            holder = self._holder()
            if holder is not None and not self._gone(holder):
                until = datetime.datetime.fromtimestamp(holder.get("expires", 0)).isoformat(timespec="seconds")
                raise CheckpointError(
                    f"output_dir {self.store.url} is in use by another run (host {holder.get('host')}, pid {holder.get('pid')}, "
                    f"since {holder.get('since')}; its lease runs until {until}); wait for it to end, or delete "
                    f"{self.store.where(LOCK_FILE)} if that run is gone") from None
            fs.pipe_file(self.path, self._body())  # taken over: the holder is gone
        self._thread = threading.Thread(target=self._renew, name="store-lease", daemon=True)
        self._thread.start()

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.store.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return None

    def _gone(self, holder: dict) -> bool:
        if holder.get("expires", 0) < time.time():
            return True
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            try:
                os.kill(holder["pid"], 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return holder["pid"] == os.getpid()  # an earlier run in this very process that never let go
        return False

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self.store.fs.pipe_file(self.path, self._body())
            except Exception:  # a store hiccup: the next renewal tries again, well inside the lease
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            holder = self._holder()
            if holder is not None and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
                self.store.fs.rm_file(self.path)
        except Exception as e:  # the run itself is done: a lock left behind only blocks others until its lease ends
            print(f"warning: could not remove {self.store.where(LOCK_FILE)} ({e.__class__.__name__}); it lapses within "
                  f"{LEASE_S // 60} minutes", file=sys.stderr)
