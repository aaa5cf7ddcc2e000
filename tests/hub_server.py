"""A tiny Hugging Face hub on 127.0.0.1 for tests: the real ``huggingface_hub`` client talks to it.

Repositories are folders: ``<root>/models/<org>/<name>/...`` and ``<root>/datasets/<org>/<name>/...``.
Each has one revision, ``main``, whose commit sha is derived from the files' contents. Served, as
huggingface_hub 2.4.0 calls them:

- ``GET /api/{models|datasets}/{org}/{name}[/revision/{rev}]`` -> ``{"id", "sha", "siblings"}``
- ``GET /api/{models|datasets}/{org}/{name}/tree/{rev}[/{path}]`` -> ``[{"type", "path", "size", "oid"}]``
- ``HEAD|GET /[datasets/]{org}/{name}/resolve/{rev}/{path}`` -> ``X-Repo-Commit``, ``ETag``,
  ``Content-Length`` (never ``X-Xet-Hash``); GET honours ``Range: bytes=N-[M]`` with a 206.
- errors: 404 + ``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound`` (``X-Repo-Commit``
  with EntryNotFound). A gated repository's info and file list are public, as on the hub; its
  files answer 401 (no token) or 403 (another token) with ``X-Error-Code: GatedRepo``.

Every request is logged (``server.log``) so tests can check what was fetched; ``cut_once`` makes
the next full GET of a file send half of it and drop the connection, once.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

API = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+?)(?:/(revision|tree)/([^/]+)(/.*)?)?/?$")
RESOLVE = re.compile(r"^/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class Request:
    method: str
    path: str  # unquoted, without the query
    range: str | None
    authorization: str | None
    status: int = 0
    body_bytes: int = 0

    @property
    def file(self) -> str | None:
        """The repository path of a resolve request."""
        m = RESOLVE.match(self.path)
        return m.group(4) if m else None


@dataclass(frozen=True)
class _Repo:
    sha: str
    files: dict  # path -> (Path on disk, size, sha256)


class HubServer:
    """``with HubServer(root) as hub: ... hub.url ... hub.log``."""

    def __init__(self, root: Path, gated: dict[str, str] | None = None, missing_status: int = 404) -> None:
        self.root = Path(root)
        self.gated = dict(gated or {})  # repo id -> the one token that has access
        self.missing_status = missing_status  # the real hub answers 401 for unknown repos to anonymous users
        self.cut_once: set[tuple[str, str]] = set()  # (repo id, path)
        self.log: list[Request] = []
        self._lock = threading.Lock()
        self._repos: dict[Path, _Repo] = {}
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> HubServer:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # -- what happened ------------------------------------------------------------------
    def requests(self, method: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if method is None or r.method == method]

    def downloads(self) -> list[Request]:
        """GETs of repository files (the bytes), in order."""
        return [r for r in self.requests("GET") if r.file is not None]

    def clear(self) -> None:
        with self._lock:
            self.log.clear()

    def _record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)

    # -- repositories -------------------------------------------------------------------
    def repo(self, kind: str, repo_id: str) -> _Repo | None:
        folder = self.root / kind / repo_id
        if not folder.is_dir():
            return None
        with self._lock:
            if folder not in self._repos:
                files = {}
                for p in sorted(folder.rglob("*")):
                    if p.is_file():
                        data = p.read_bytes()
                        files[p.relative_to(folder).as_posix()] = (p, len(data), hashlib.sha256(data).hexdigest())
                sha = hashlib.sha1(json.dumps([(k, v[2]) for k, v in files.items()]).encode()).hexdigest()
                self._repos[folder] = _Repo(sha=sha, files=files)
            return self._repos[folder]


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # quiet: the hub's log is the record
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    # -- helpers --------------------------------------------------------------------------
    def _send(self, status: int, headers: dict | None = None, body: bytes = b"", send_body: bool = True) -> None:
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)
            self.entry.body_bytes += len(body)
        self.entry.status = status

    def _json(self, status: int, data, headers: dict | None = None, send_body: bool = True) -> None:
        self._send(status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(data).encode(), send_body)

    def _error(self, status: int, code: str | None, message: str, send_body: bool, extra: dict | None = None) -> None:
        headers = {"X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers, send_body)

    def _serve(self, body: bool) -> None:
        split = urlsplit(self.path)
        path = unquote(split.path)
        self.entry = Request(self.command, path, self.headers.get("Range"), self.headers.get("Authorization"))
        try:
            if m := API.match(split.path):
                kind, repo_id, op, rev, sub = m.group(1), unquote(m.group(2)), m.group(3), m.group(4), m.group(5)
                self._api(kind, repo_id, op, unquote(rev) if rev else "main", unquote(sub or "").strip("/"), body)
            elif m := RESOLVE.match(split.path):
                kind = "datasets" if m.group(1) else "models"
                self._resolve(kind, unquote(m.group(2)), unquote(m.group(3)), unquote(m.group(4)), body)
            else:
                self._error(404, None, "Not Found", body)
        finally:
            self.hub._record(self.entry)

    def _repo_or_error(self, kind: str, repo_id: str, rev: str, send_body: bool, files: bool = False):
        repo = self.hub.repo(kind, repo_id)
        if repo is None:
            self._error(self.hub.missing_status, "RepoNotFound", "Repository not found", send_body)
            return None
        token = self.hub.gated.get(repo_id)
        if files and token is not None and self.headers.get("Authorization") != f"Bearer {token}":
            if self.headers.get("Authorization"):
                self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in the authorized list.", send_body)
            else:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in.", send_body)
            return None
        if rev not in ("main", repo.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", send_body)
            return None
        return repo

    def _api(self, kind: str, repo_id: str, op: str | None, rev: str, sub: str, send_body: bool) -> None:
        repo = self._repo_or_error(kind, repo_id, rev, send_body)
        if repo is None:
            return
        if op in (None, "revision"):
            self._json(200, {"id": repo_id, "sha": repo.sha, "private": False,
                             "gated": "manual" if repo_id in self.hub.gated else False,
                             "siblings": [{"rfilename": f} for f in repo.files]}, send_body=send_body)
            return
        prefix = f"{sub}/" if sub else ""
        entries, folders = [], set()
        for f, (_, size, digest) in repo.files.items():
            if not f.startswith(prefix):
                continue
            parts = f.split("/")
            for i in range(1, len(parts)):
                folders.add("/".join(parts[:i]))
            entries.append({"type": "file", "path": f, "size": size, "oid": hashlib.sha1(digest.encode()).hexdigest()})
        entries += [{"type": "directory", "path": d, "size": 0, "oid": hashlib.sha1(d.encode()).hexdigest()}
                    for d in sorted(folders) if d.startswith(prefix)]
        if sub and not entries:
            self._error(404, "EntryNotFound", f"{sub} does not exist", send_body, {"X-Repo-Commit": repo.sha})
            return
        self._json(200, entries, send_body=send_body)

    def _resolve(self, kind: str, repo_id: str, rev: str, file: str, send_body: bool) -> None:
        repo = self._repo_or_error(kind, repo_id, rev, send_body, files=True)
        if repo is None:
            return
        if file not in repo.files:
            self._error(404, "EntryNotFound", f"{file} does not exist", send_body, {"X-Repo-Commit": repo.sha})
            return
        disk, size, digest = repo.files[file]
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{digest}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if not send_body:
            self._send(200, {**headers, "Content-Length": str(size)}, send_body=False)
            return
        data = disk.read_bytes()
        start, end = 0, size - 1
        if rng := self.headers.get("Range"):
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) >= size:
                self._send(416, {"Content-Range": f"bytes */{size}"})
                return
            start, end = int(m.group(1)), min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        chunk = data[start:end + 1]
        if rng:
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        key = (repo_id, file)
        with self.hub._lock:
            cut = not rng and key in self.hub.cut_once
            self.hub.cut_once.discard(key)
        if cut:  # promise everything, send half, drop the connection
            self.send_response(200)
            for k, v in {**headers, "Content-Length": str(size)}.items():
                self.send_header(k, v)
            self.end_headers()
            half = data[: size // 2]
            self.wfile.write(half)
            self.wfile.flush()
            self.entry.status, self.entry.body_bytes = 200, len(half)
            self.close_connection = True
            return
        self._send(206 if rng else 200, headers, chunk)
