"""A run whose ``output_dir`` is an object-store URL (``s3://bucket/prefix``).

The run works in a local mirror of the prefix (``$WAYPOINT_CACHE/runs/s3/bucket/prefix``, default cache
``~/.cache/waypoint``): each step is written and committed there as on any disk, then uploaded, manifest last
(``waypoint.checkpointers.object_store``); under torchrun each rank uploads the shards it wrote from its own
machine's mirror, so machines need no shared disk. The store is the truth: at start every machine's mirror drops
any step the store has not committed, and the newest committed step is downloaded (and its hashes verified) where
a mirror lacks it, so a rerun on other machines resumes the same way. ``metrics.jsonl`` is uploaded after every step.

One run per prefix: a lock object ``.waypoint.lock`` created only if absent (S3's ``If-None-Match: *``), holding a
lease that the run renews every minute; a lock whose lease ran out, or whose holder was a process of this host
that is gone (a SIGKILL), is taken over. A store that ignores conditional writes leaves a small window where two
runs starting at the same moment both take it.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from waypoint.checkpointers.commit import step_dirs, verify
from waypoint.checkpointers.object_store import ObjectStore, cache_dir, input_copy_path, is_url, local_copy, store_errors
from waypoint.errors import CheckpointError

LOCK = ".waypoint.lock"
LEASE_S = 600  # a lock not renewed for this long belongs to a run that is gone
RENEW_S = 60
METRICS = "metrics.jsonl"


def mirror_dir(url: str) -> Path:
    """Where a run on ``url`` works locally."""
    return cache_dir() / "runs" / url.rstrip("/").replace("://", "/", 1)


class StoreLease:
    """The lock object of a prefix (see the module's docstring)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store, self.path = store, store.path(LOCK)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "since": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)[:500]}

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
                    f"{self.store.where(LOCK)} if that run is gone") from None
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
            print(f"warning: could not remove {self.store.where(LOCK)} ({e.__class__.__name__}); it lapses within "
                  f"{LEASE_S // 60} minutes", file=sys.stderr)


def cache_inputs(cfg, dist, say=print) -> None:
    """Inputs named by object-store URLs (the checkpoint, a dataset: any config string but ``output_dir``) are
    copied to ``$WAYPOINT_CACHE/inputs/...`` on every machine with a size check (files already there with the object's size are
    kept), and the config points at the copies; a URL inside one already copied (the checkpoint's tokenizer,
    interpolated from it) points inside that copy."""
    found = sorted({v for k, v in _strings(OmegaConf.to_container(cfg, resolve=True)) if k != "output_dir" and is_url(v)}, key=len)
    local: dict[str, Path] = {}
    for url in found:
        inside = next((u for u in local if url.startswith(u.rstrip("/") + "/")), None)
        if inside is not None:
            local[url] = local[inside] / url[len(inside.rstrip("/")) + 1:]
            continue
        local[url] = input_copy_path(url)
        dist.run_on_each_machine(lambda url=url: local_copy(url, say) and None)
    if local:
        _replace(cfg, {u: str(p) for u, p in local.items()})
        with open_dict(cfg):
            cfg.input_copies = {str(p): u for u, p in local.items()}


def config_as_given(cfg) -> dict:
    """The resolved config as the user gave it: object-store URLs where the run uses local copies and mirrors, so
    a run resumed on another machine (another cache) has the same config as the one it continues."""
    config = OmegaConf.to_container(cfg, resolve=True)
    copies = config.pop("input_copies", None) or {}
    store = config.pop("output_store", None)

    def back(node):
        if isinstance(node, dict):
            return {k: back(v) for k, v in node.items()}
        if isinstance(node, list):
            return [back(v) for v in node]
        return copies.get(node, node) if isinstance(node, str) else node
    config = back(config)
    if store:
        config["output_dir"] = store
    return config


def _strings(node, key: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, key)
    elif isinstance(node, str):
        yield key, node


def _replace(node, mapping: dict[str, str]) -> None:
    """Every string value of a (resolved) config found in ``mapping``, replaced in place."""
    items = node.items() if isinstance(node, DictConfig) else enumerate(node)
    for k, v in list(items):
        if isinstance(v, (DictConfig, ListConfig)):
            _replace(v, mapping)
        elif isinstance(v, str) and v in mapping and k != "output_dir":
            node[k] = mapping[v]


@contextmanager
def object_store_output(cfg, dist):
    """Inputs from object stores cached locally (``cache_inputs``); for an object-store ``output_dir``: hold the
    prefix's lock, and let the run work in its local mirror (``cfg.output_dir`` becomes the mirror,
    ``cfg.output_store`` the URL). Local paths: nothing changes."""
    cache_inputs(cfg, dist)
    url = str(cfg.output_dir)
    if not is_url(url):
        yield
        return
    store = ObjectStore(url)
    local = mirror_dir(url)
    with open_dict(cfg):
        cfg.output_dir, cfg.output_store = str(local), store.url
    lease = StoreLease(store) if dist.is_main else None

    def take() -> None:
        local.mkdir(parents=True, exist_ok=True)
        with store_errors(store.url, "take the run's lock object"):
            lease.acquire()
    dist.run_on_main(take)
    try:
        yield
    finally:
        if lease is not None:
            lease.release()


def sync_mirror(cfg, say=print) -> None:
    """Before a run chooses where to start (rank 0): the mirror holds no step that the store has not committed,
    and holds the newest committed one (downloaded and verified); a store holding steps of which none is committed
    is refused unless ``overwrite``, and a fresh run (``resume=false``) on a prefix with committed steps always is."""
    with store_errors(cfg.output_store, "read its checkpoints"):
        _sync_mirror(ObjectStore(cfg.output_store), Path(cfg.output_dir), cfg, say)


def _sync_mirror(store: ObjectStore, local: Path, cfg, say) -> None:
    remote = store.steps()
    for path in step_dirs(local):
        if path.name not in remote or store.manifest(path.name) is None:
            shutil.rmtree(path)  # a cached copy of a step the store does not hold committed
    if not (local / METRICS).exists():
        store.get(METRICS, local / METRICS)
    fresh = cfg.resume in (False, "false", "False", "no")
    if fresh and any(store.manifest(n) is not None for n in remote):
        raise CheckpointError(f"output_dir {store.url} already holds checkpoints; resume=auto continues them; an object-store "
                              "output_dir is never overwritten: choose another prefix")
    if fresh or cfg.resume not in (True, "auto", "true", "True"):
        return
    for name in remote:
        checked = store.check(name)
        if checked.ok and (local / name).is_dir():
            if verify(local / name, hash_contents=False).ok:
                return
            shutil.rmtree(local / name)  # a cached copy that lost files: fetched again
        if checked.ok:
            checked = store.download(name, local / name)
            if checked.ok:
                say(f"downloaded {store.where(name)} ({checked.files} files, {checked.bytes / 1e9:.2f} GB, hashes verified)")
                return
        say(f"warning: skipping {store.where(name)}: {checked.problem}")
    if remote and not cfg.overwrite:
        raise CheckpointError(f"output_dir {store.url} holds checkpoints but none is committed and complete; "
                              "set overwrite=true to start again (what is there is moved aside, never deleted)")


def stored_at(cfg, path: Path) -> str:
    """Where a run's step is kept for good, for the run's last line: its URL in an object-store run ("" otherwise)."""
    return f"{cfg.output_store}/{Path(path).name}; a local copy: " if cfg.get("output_store") else ""


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
            if (self.local / METRICS).exists():
                self.store.put(self.local / METRICS, METRICS)
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
            raise CheckpointError(f"could not {doing}: {e} ({e.__class__.__name__}){where}; "
                                  "the store's earlier checkpoints are intact") from e
