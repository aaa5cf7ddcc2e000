"""Step checkpoints in an object store (``s3://``, ``gs://``, ``az://``: any fsspec URL whose package is
installed), committed without a rename.

Object stores have no atomic rename, so a step is committed by its manifest, written last:

1. every file of ``step_N/`` is uploaded (several files at once, large ones as parallel multipart parts);
2. ``MANIFEST.json`` (each file's size and BLAKE3 hash, from the local commit) is uploaded last;
3. a step counts as committed only when its manifest exists and every object it lists has the listed size;
   the hashes are checked on the copy downloaded to resume from.

Retention deletes a step's manifest first, then its objects, so a half-deleted step is never taken for a good
one. An upload killed half way leaves objects without a manifest, which nothing takes for a checkpoint; a later
save of the same step first moves them aside (``step_N.partial``), so nothing is deleted silently.
Endpoint, region and credentials come from the client's usual environment variables and config files
(``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...) and are never printed; missing credentials or an unreachable endpoint
are one line naming the URL and what to set (``store_errors``). A scheme in any case is the store's (``S3://``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit


from waypoint import console
from waypoint.checkpointers.commit import MANIFEST, MANIFEST_VERSION, Verification, fsync_dir, safe_relative, verify
from waypoint.errors import CheckpointError, first_line
from waypoint.run.step_dirs import step_number

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # a URL's scheme, in any case (S3:// is s3://)
PARALLEL_FILES = 4  # files uploaded at once (each large one in parallel parts as well)
CREDENTIALS = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a profile of ~/.aws/credentials"
ENDPOINT = "set AWS_ENDPOINT_URL to the store's endpoint (unset for AWS S3) and check that it is reachable"


def url_scheme(path) -> str | None:
    """The scheme of a URL (``s3`` for ``S3://bucket``), lower case; None for a path."""
    match = SCHEME.match(str(path))
    return match.group(1).lower() if match else None


def is_url(path) -> bool:
    """An object-store location (``s3://bucket/prefix``, the scheme in any case); ``file://`` and plain paths are local."""
    return url_scheme(path) not in (None, "file")


def store_url(url: str) -> str:
    """``url`` with its scheme in lower case (fsspec knows ``s3``, not ``S3``) and no trailing slash."""
    scheme = url_scheme(url)
    return f"{scheme}{str(url)[len(scheme):]}".rstrip("/") if scheme else str(url).rstrip("/")


def cache_dir() -> Path:
    """Where object-store inputs and run mirrors are kept locally: ``$WAYPOINT_CACHE`` or ``~/.cache/waypoint``."""
    return Path(os.environ.get("WAYPOINT_CACHE", "~/.cache/waypoint")).expanduser()


def input_copy_path(url: str) -> Path:
    return cache_dir() / "inputs" / store_url(url).replace("://", "/", 1)


def local_copy(path, say=None) -> Path:
    """``path`` itself when local; for a URL its local copy (``fetch``: files already cached with the object's size
    are kept). Every script that reads a checkpoint goes through this, so a step in an object store is read by
    the same code as one on disk."""
    if not is_url(path):
        return Path(path)
    local = input_copy_path(str(path))
    with store_errors(str(path), "read it"):
        files, size = ObjectStore(str(path)).fetch(local)
    if say is not None:
        say(f"{path}: {files} files ({size / 1e9:.2f} GB) downloaded to {local}" if files else f"{path}: cached at {local}")
    return local


def access_problem(e: BaseException) -> tuple[str, str] | None:
    """(what went wrong, what to set) when ``e``, or an error it was raised from, is botocore's for missing
    credentials or an unreachable endpoint; None for any other failure (and without botocore)."""
    try:
        from botocore import exceptions as boto
    except ImportError:
        return None
    while e is not None:
        if isinstance(e, boto.ProfileNotFound):  # AWS_PROFILE (or a config's profile) names none that exists
            profile = e.kwargs.get("profile", "")
            return (f"no usable credentials (AWS profile {profile!r} not found; ProfileNotFound)",
                    "set AWS_PROFILE to a profile of ~/.aws/config or ~/.aws/credentials, or unset it")
        if isinstance(e, (boto.NoCredentialsError, boto.PartialCredentialsError, boto.CredentialRetrievalError)):
            return f"no usable credentials ({e}; {e.__class__.__name__})", CREDENTIALS
        if isinstance(e, boto.ConnectionError):  # EndpointConnectionError, ConnectTimeoutError, ...
            endpoint = urlsplit(str(e.kwargs.get("endpoint_url", "")))
            where = f"{endpoint.scheme}://{endpoint.netloc}" if endpoint.netloc else "the store's endpoint"
            return f"cannot connect to {where} ({e.__class__.__name__})", ENDPOINT
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return None


@contextmanager
def store_errors(url: str, doing: str):
    """A store's failures (a missing bucket, denied access, no credentials, an unreachable endpoint) as one line
    naming the URL and what to set."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        access = access_problem(e)
        if access is not None:
            raise CheckpointError(f"{url}: could not {doing}: {access[0]}; {access[1]}") from e
        if not isinstance(e, (OSError, ValueError, RuntimeError)) and not type(e).__module__.startswith("botocore."):
            raise
        raise CheckpointError(f"{url}: could not {doing}: {first_line(e)} ({e.__class__.__name__}); check the bucket, "
                              "the credentials and AWS_ENDPOINT_URL (or your store's settings)") from e


class ObjectStore:
    """``url``'s prefix, holding ``step_N/`` the way ``output_dir`` holds them on disk."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = store_url(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as e:
            scheme = url_scheme(self.url)
            package = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(scheme, f"an fsspec package for {scheme}://")
            raise CheckpointError(f"{self.url}: cannot open this object store ({e.__class__.__name__}); pip install {package}") from None

    def path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    # -- reading ---------------------------------------------------------------------
    def steps(self) -> list[str]:
        """Names of the ``step_N`` prefixes, newest (highest N) first, committed or not."""
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries}
        numbered = [(step_number(n), n) for n in names if step_number(n) is not None]
        return [n for _, n in sorted(numbered, reverse=True)]

    def manifest(self, name: str) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path(f"{name}/{MANIFEST}")))
        except FileNotFoundError:
            return None

    def sizes(self, name: str) -> dict[str, int]:
        """Each object under ``name``: its path relative to ``name`` -> its size."""
        return {p[len(self.path(name)) + 1:]: info["size"] for p, info in self.fs.find(self.path(name), detail=True).items()}

    def check(self, name: str) -> Verification:
        """Whether ``name`` is committed: its manifest exists and every object it lists has the listed size."""
        where = Path(self.where(name))
        try:
            manifest = self.manifest(name)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return Verification(where, False, problem=f"unreadable {MANIFEST} ({e.__class__.__name__})")
        if manifest is None:
            return Verification(where, False, problem=f"no {MANIFEST} (an upload that did not finish)")
        if manifest.get("format_version") != MANIFEST_VERSION or not isinstance(manifest.get("files"), dict):
            return Verification(where, False, problem=f"{MANIFEST} is not a manifest of this version")
        sizes = self.sizes(name)
        total = 0
        for file, entry in manifest["files"].items():
            if not safe_relative(file):
                return Verification(where, False, problem=f"{MANIFEST} names {file!r}, outside the checkpoint")
            if file not in sizes:
                return Verification(where, False, problem=f"{file} is missing")
            if sizes[file] != entry["size"]:
                return Verification(where, False, problem=f"{file} has {sizes[file]} bytes, manifest says {entry['size']}")
            total += entry["size"]
        return Verification(where, True, files=len(manifest["files"]), bytes=total)

    def download(self, name: str, local: Path) -> Verification:
        """Copy committed step ``name`` to ``local`` (which must not exist) and verify every hash there; the copy
        is staged under a hidden name, so a kill leaves no ``local`` that is half there."""
        manifest = self.manifest(name)
        staging = local.with_name(f".{local.name}.download-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        sizes = {f: e["size"] for f, e in manifest["files"].items()} | {MANIFEST: 0}
        self._get_all([(self.path(f"{name}/{f}"), staging / f, size) for f, size in sizes.items()], f"download {name}")
        checked = verify(staging)
        if not checked.ok:
            shutil.rmtree(staging, ignore_errors=True)
            return Verification(Path(self.where(name)), False, problem=checked.problem)
        try:
            os.rename(staging, local)
        except OSError:  # another machine sharing this cache put the same step there meanwhile
            shutil.rmtree(staging, ignore_errors=True)
            if not local.is_dir():
                raise
        fsync_dir(local.parent)
        return verify(local, hash_contents=False)

    # -- writing ---------------------------------------------------------------------
    def upload(self, local: Path, name: str | None = None, sent: frozenset[str] = frozenset(), replace: bool = False) -> int:
        """Upload the committed local step directory ``local`` as ``name``: its files, then its manifest last.
        Objects already under ``name`` (an upload that did not finish) are moved aside first, unless ``sent`` names
        files that other processes already uploaded for this step (``send``; the caller set leftovers aside
        before they began), or files already there intact (``replace``: a repair, which overwrites the others in
        place under the manifest): those are checked against the manifest instead. Returns the bytes in the step."""
        name = name or local.name
        manifest = json.loads((local / MANIFEST).read_text())
        if not sent and not replace and self.fs.exists(self.path(name)):
            self.set_aside(name, "partial")
        self.send(local, name, [f for f in manifest["files"] if f not in sent])
        if sent:
            there = self.sizes(name)
            wrong = next((f for f in sorted(sent) if there.get(f) != manifest["files"][f]["size"]), None)
            if wrong is not None:
                raise CheckpointError(f"{self.where(name)}/{wrong}: missing or of the wrong size after its upload; "
                                      "the step is not committed")
        self.fs.put_file(str(local / MANIFEST), self.path(f"{name}/{MANIFEST}"))  # the commit
        return sum(e["size"] for e in manifest["files"].values())

    def send(self, local: Path, name: str, files: list[str]) -> int:
        """Upload ``files`` (relative to the directory ``local``) under ``name``, the largest first,
        ``PARALLEL_FILES`` at a time, with a progress bar; the bytes sent."""
        sizes = {f: (local / f).stat().st_size for f in files}
        with console.byte_bar(sum(sizes.values()), f"upload {name}", leave=False) as bar:
            def put(file: str) -> None:
                self.fs.put_file(str(local / file), self.path(f"{name}/{file}"))
                bar.update(sizes[file])
            with ThreadPoolExecutor(PARALLEL_FILES) as pool:
                list(pool.map(put, sorted(files, key=lambda f: -sizes[f])))
        return sum(sizes.values())

    def delete(self, name: str) -> None:
        """Remove step ``name``: its manifest first (from then on it is not a checkpoint), then its objects."""
        try:
            self.fs.rm_file(self.path(f"{name}/{MANIFEST}"))
        except FileNotFoundError:
            pass
        if self.fs.exists(self.path(name)):
            self.fs.rm(self.path(name), recursive=True)

    def set_aside(self, name: str, suffix: str, files: list[str] | None = None) -> str:
        """Move ``name``'s objects to ``name.<suffix>`` (or ``.<suffix>2``...): copied, then deleted, manifest first.
        ``files``: only these objects, copied (the caller replaces them next)."""
        existing = {e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False, refresh=True)}
        aside, n = f"{name}.{suffix}", 1
        while aside in existing:
            n += 1
            aside = f"{name}.{suffix}{n}"
        prefix = self.path(name)
        for source in self.fs.find(prefix) if files is None else [f"{prefix}/{f}" for f in files]:
            self.fs.copy(source, self.path(aside) + source[len(prefix):])
        if files is None:
            self.delete(name)
        return aside

    def prune(self, keep_last_n: int | None) -> list[str]:
        """Delete committed steps beyond the newest ``keep_last_n`` (only after a newer one committed: the caller
        prunes after its upload); uncommitted leftovers are never counted or touched."""
        if not keep_last_n:
            return []
        committed = [n for n in self.steps() if self.manifest(n) is not None]
        for name in committed[keep_last_n:]:
            self.delete(name)
        return committed[keep_last_n:]

    def fetch(self, local: Path) -> tuple[int, int]:
        """Copy everything under the prefix (a checkpoint directory, or one file) to ``local``, skipping files
        already there with the object's size; (files fetched, bytes fetched). A file is fetched under a hidden
        name and renamed into place, so a kill never leaves a short file that the size check would take."""
        if self.fs.isfile(self.root):
            objects = {"": self.fs.info(self.root)["size"]}
        else:
            objects = {p[len(self.root) + 1:]: info["size"] for p, info in self.fs.find(self.root, detail=True).items()}
        if not objects:
            raise CheckpointError(f"{self.url}: nothing there")
        targets = {name: (local / name) if name else local for name in objects}
        fetched = [(n, size) for n, size in objects.items() if not targets[n].is_file() or targets[n].stat().st_size != size]
        total = sum(size for _, size in fetched)
        self._get_all([(self.path(n) if n else self.root, targets[n], size) for n, size in fetched], f"download {self.url}")
        return len(fetched), total

    def _get_all(self, items: list[tuple[str, Path, int]], desc: str) -> None:
        """Download (object, local file, size) items, ``PARALLEL_FILES`` at a time, with a progress bar; each file
        under a hidden name renamed into place, so a kill never leaves a short file under the real name."""
        with console.byte_bar(sum(size for *_, size in items), desc, leave=False) as bar:
            def get(item: tuple[str, Path, int]) -> None:
                source, target, size = item
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(f".{target.name}.part-{os.getpid()}")
                self.fs.get_file(source, str(part))
                os.replace(part, target)
                bar.update(size)
            with ThreadPoolExecutor(PARALLEL_FILES) as pool:
                list(pool.map(get, items))

    def put(self, local: Path, name: str) -> None:
        """A run file beside the steps (``metrics.jsonl``), replaced whole."""
        self.fs.put_file(str(local), self.path(name))

    def get(self, name: str, local: Path) -> bool:
        """Fetch a run file if the store has it."""
        try:
            self.fs.get_file(self.path(name), str(local))
        except FileNotFoundError:
            return False
        return True
