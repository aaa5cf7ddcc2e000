"""Hugging Face hub downloads: ``huggingface_hub.snapshot_download`` with Waypoint's file choice,
``hf://`` URIs in configs, and one-line errors.

    download("meta-llama/Llama-2-7b-hf")             # -> Snapshot(path=<cache>/snapshots/<sha>, ...)
    resolve_hf_uri("hf://meta-llama/Llama-2-7b-hf@main")
    resolve_hf_uri("hf://datasets/yahma/alpaca-cleaned/alpaca_data_cleaned.json")
    resolve_hf_uris(cfg)                               # every "hf://..." string in a config, in place

Which files: unless patterns are given, a model repository gives one copy of the weights
(safetensors when it has both safetensors and ``.bin``), its config and tokenizer files,
without ``original/`` (Meta's consolidated checkpoint) or other frameworks' weights;
``fmt="meta"`` gives the reverse: ``original/consolidated.*.pth``, ``params.json`` and
``tokenizer.model``. The choice is made from the repository's file list at the resolved commit.

Downloads go through the hub cache (``HF_HOME``/``HF_HUB_CACHE``) or into ``local_dir``: files
already there are not fetched again (so rerunning after an interruption fetches only what is
missing; huggingface_hub 2.4 discards a killed process's partial file), a dropped connection
resumes the file with a Range request, and with ``HF_HUB_OFFLINE=1`` the cache answers without
any request (as it does, with a warning, when the hub cannot be reached). Free disk space is
checked before anything is fetched. The token comes from ``token``, ``HF_TOKEN`` or the stored
login (``hf auth login``) and never appears in messages or in the recorded files.

Next to the files, ``waypoint_source.json`` records the repository id, type and resolved commit
(``read_source(path)`` reads it back), for provenance and adapters' ``base_model_name_or_path``.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator, MutableMapping, MutableSequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

import httpx2
from huggingface_hub import HfApi, constants, get_cached_repo_tree, snapshot_download
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import filter_repo_objects

from waypoint.cli.hub_source import SOURCE_FILE, base_model_name, read_source  # noqa: F401 (the record of a download)
from waypoint.errors import CheckpointError, first_line

log = logging.getLogger(__name__)

HF_SCHEME = "hf://"
REPO_TYPES = ("model", "dataset")
FORMATS = ("hf", "meta")
WEIGHT_CHOICES = ("safetensors", "bin")

# Weights of other frameworks and runtimes: never what a PyTorch fine-tune reads.
OTHER_FRAMEWORKS = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.tflite", "*.gguf", "*.mlmodel",
                    "onnx/*", "coreml/*", "*.mlpackage/*"]
META_FILES = ["consolidated.*.pth", "params.json", "tokenizer.model"]
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")
DATA_METADATA = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}


class HubError(CheckpointError):
    """A download that cannot be done as asked; the message is one line naming what is wrong."""


@dataclass(frozen=True)
class HfUri:
    """``hf://[datasets/]org/name[@revision][/path]``."""

    repo_id: str
    repo_type: str = "model"
    revision: str | None = None
    path: str | None = None  # a file or folder inside the repository


@dataclass(frozen=True)
class Snapshot:
    """What ``download`` gives back."""

    path: Path  # what the caller asked for: the snapshot root, a folder in it (Meta's original/) or a file
    root: Path  # the snapshot root (cache snapshots/<sha> or local_dir), where SOURCE_FILE is
    repo_id: str
    repo_type: str
    revision: str  # the resolved commit sha
    requested_revision: str  # what was asked for: "main", a tag, a branch or the sha itself
    files: tuple[str, ...]  # the repository files selected
    fetched: tuple[str, ...] = ()  # those of them that were not on disk before this call
    fetched_bytes: int = 0
    allow_patterns: list[str] | None = field(default=None, compare=False)
    ignore_patterns: list[str] | None = field(default=None, compare=False)


# -- where: endpoint, cache, offline, read when called (not when huggingface_hub was imported) ----
def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def offline_mode() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def repo_page_url(repo_id: str, repo_type: str = "model", endpoint: str | None = None) -> str:
    """The repository's page on the hub (where a gated repository's licence is accepted)."""
    prefix = "datasets/" if repo_type == "dataset" else ""
    return f"{hub_endpoint(endpoint)}/{prefix}{repo_id}"


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or would hold it: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


# -- hf:// ---------------------------------------------------------------------------------
def is_hf_uri(value: object) -> bool:
    return isinstance(value, str) and value.startswith(HF_SCHEME)


def parse_hf_uri(uri: str) -> HfUri:
    """``hf://org/name[@rev][/path]`` (a model) or ``hf://datasets/org/name[@rev][/path]``."""
    if not is_hf_uri(uri):
        raise HubError(f"{uri!r}: not an hf:// URI (expected hf://org/name[@revision] or hf://datasets/org/name[/file])")
    parts = [p for p in uri[len(HF_SCHEME):].split("/") if p]
    repo_type = "model"
    if parts and parts[0] == "datasets":
        repo_type, parts = "dataset", parts[1:]
    if len(parts) < 2 or "@" in parts[0]:
        form = "hf://datasets/org/name[@revision][/file]" if repo_type == "dataset" else "hf://org/name[@revision][/path]"
        raise HubError(f"{uri!r}: expected {form}")
    name, _, revision = parts[1].partition("@")
    if not name or (_ and not revision):
        raise HubError(f"{uri!r}: empty repository name or revision")
    return HfUri(repo_id=f"{parts[0]}/{name}", repo_type=repo_type, revision=unquote(revision) if revision else None,
                 path="/".join(parts[2:]) or None)


# -- which files --------------------------------------------------------------------------
def default_patterns(files: list[str] | dict, fmt: str = "hf", weights: str | None = None,
                     repo_type: str = "model") -> tuple[list[str] | None, list[str] | None, str]:
    """``(allow_patterns, ignore_patterns, root)`` for a repository holding ``files``.

    ``root`` is the folder (relative, "" for the top) where the checkpoint is: ``original`` for
    Meta's files under ``original/``.
    """
    if repo_type == "dataset":
        return None, None, ""
    files = list(files)
    if fmt == "meta":
        for root in ("original", ""):
            prefix = f"{root}/" if root else ""
            if any(fnmatch.fnmatch(f, prefix + "consolidated.*.pth") and "/" not in f[len(prefix):] for f in files):
                return [prefix + p for p in META_FILES], None, root
        raise HubError("no Meta-format checkpoint in the repository (no original/consolidated.*.pth or consolidated.*.pth); "
                       "drop --format meta for its Hugging Face files")
    if fmt != "hf":
        raise HubError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    outside = [f for f in files if not f.startswith("original/")]
    has = {"safetensors": any(f.endswith(".safetensors") for f in outside),
           "bin": any(f.endswith(".bin") and not f.endswith("training_args.bin") for f in outside)}
    if weights is not None and weights not in WEIGHT_CHOICES:
        raise HubError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_CHOICES)}")
    if weights is not None and not has[weights]:
        present = [k for k, v in has.items() if v]
        raise HubError(f"the repository has no {weights} weights"
                       + (f" (it has {', '.join(present)})" if present else " (nor any other HF-format weights)"))
    chosen = weights or ("safetensors" if has["safetensors"] else "bin" if has["bin"] else None)
    ignore = ["original/*", *OTHER_FRAMEWORKS]
    if chosen == "safetensors":
        ignore += ["*.bin", "*.bin.index.json", "*.pth", "*.pt"]
    elif chosen == "bin":
        ignore += ["*.safetensors", "*.safetensors.index.json", "*.pth", "*.pt"]
    return None, ignore, ""


def choose_data_file(files: list[str], label: str) -> str:
    """The data file among a dataset repository's ``files``: the only .json/.jsonl/.parquet one, else the
    only one with "train" in its name; an error names the candidates otherwise."""
    candidates = sorted(f for f in files if f.endswith(DATA_SUFFIXES) and PurePosixPath(f).name not in DATA_METADATA)
    if len(candidates) == 1:
        return candidates[0]
    train = [f for f in candidates if "train" in PurePosixPath(f).name]
    if len(train) == 1:
        return train[0]
    if not candidates:
        raise HubError(f"{label} has no .json, .jsonl or .parquet data file")
    shown = ", ".join(candidates[:5]) + (f" and {len(candidates) - 5} more" if len(candidates) > 5 else "")
    raise HubError(f"{label} has {len(candidates)} data files ({shown}); name one: hf://datasets/<org>/<name>/<file>")


# -- errors -------------------------------------------------------------------------------
@dataclass
class _Context:
    repo_id: str
    repo_type: str
    revision: str | None
    endpoint: str
    cache: Path
    offline: bool
    token_given: bool

    @property
    def label(self) -> str:
        kind = "dataset " if self.repo_type == "dataset" else ""
        return f"{kind}{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


def _explain(e: BaseException, c: _Context) -> str:
    status = getattr(getattr(e, "response", None), "status_code", None)
    page = repo_page_url(c.repo_id, c.repo_type, c.endpoint)
    server_says = getattr(getattr(e, "response", None), "headers", {}).get("X-Error-Message") or ""
    if status == 401 and "invalid credentials" in server_says.lower():
        return (f"the hub at {c.endpoint} rejected the token in use as invalid while fetching {c.label}: set HF_TOKEN to a "
                "valid token (or log in with `hf auth login`)")
    if isinstance(e, GatedRepoError):
        return (f"{c.label} is a gated repository and {_token_problem(c, status)}: accept its licence at {page} "
                "(access may need approval) and set HF_TOKEN to a token of the account that accepted it")
    if isinstance(e, RepositoryNotFoundError):
        if status in (401, 403):
            return (f"repository {c.label} not found on {c.endpoint}, or it is private or gated and {_token_problem(c, status)}: "
                    f"check the name, and set HF_TOKEN to a token with access to it (a gated one's licence is at {page})")
        return f"repository {c.label} not found on {c.endpoint}"
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return (f"the hub at {c.endpoint} refused {c.label} (HTTP {status}): {_token_problem(c, status)}; set HF_TOKEN "
                f"(or run `hf auth login`) to a token with access to {c.repo_id}")
    if isinstance(e, RevisionNotFoundError):
        return f"revision {c.revision or constants.DEFAULT_REVISION!r} not found in {c.repo_id} on {c.endpoint}"
    if isinstance(e, RemoteEntryNotFoundError):
        url = str(getattr(getattr(e, "response", None), "url", ""))
        _, _, after = url.partition("/resolve/")
        name = unquote(after.split("?", 1)[0].split("/", 1)[1]) if "/" in after else "a file"
        return f"file {name} not found in {c.label}"
    if isinstance(e, IncompleteSnapshotError):
        missing = re.search(r"\d+ file\(s\) are missing \([^)]*\)", str(e))
        what = missing.group(0) if missing else "files are missing"
        how = "unset HF_HUB_OFFLINE to complete it" if c.offline else "rerun with network access to complete it"
        return f"the cached copy of {c.label} in {c.cache} is incomplete ({what}); {how}"
    cause = e.__cause__ if isinstance(e, (RevisionResolutionError, LocalEntryNotFoundError)) and e.__cause__ else e
    cause_status = getattr(getattr(cause, "response", None), "status_code", None)
    if c.offline and isinstance(e, (RevisionResolutionError, LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return f"HF_HUB_OFFLINE=1 is set and {c.label} is not in the cache ({c.cache}); unset HF_HUB_OFFLINE to download it"
    if isinstance(cause, HfHubHTTPError) and cause_status:
        return f"the hub at {c.endpoint} answered HTTP {cause_status} for {c.label}: {first_line(cause)}"
    if isinstance(cause, (httpx2.TransportError, OfflineModeIsEnabled, RevisionResolutionError, LocalEntryNotFoundError, ConnectionError)):
        return (f"cannot reach the Hugging Face hub at {c.endpoint} to download {c.label} ({type(cause).__name__}) and it is "
                "not in the cache: check the network or proxy, or set HF_HUB_OFFLINE=1 to use a copy already cached")
    if isinstance(e, HFValidationError):
        return f"{c.label}: {first_line(e)}"
    return f"downloading {c.label} failed: {type(e).__name__}: {first_line(e)}"


def _token_problem(c: _Context, status: int | None) -> str:
    """What is wrong with the token (never the token itself) when the hub refuses with ``status``."""
    if not c.token_given:
        return "no token is set (HF_TOKEN, or `hf auth login`)"
    if status == 401:
        return "the token in use is invalid or lacks access to it"
    return "the token in use lacks access to it"


@contextmanager
def _hub_errors(c: _Context) -> Iterator[None]:
    try:
        yield
    except HubError:
        raise
    except (HfHubHTTPError, httpx2.HTTPError, RevisionResolutionError, LocalEntryNotFoundError, OfflineModeIsEnabled,
            HFValidationError, OSError) as e:
        raise HubError(_explain(e, c)) from e


# -- download -----------------------------------------------------------------------------
def _repo_files(api: HfApi, c: _Context, commit: str, cache: Path, local_dir: Path | None,
                offline: bool) -> tuple[dict[str, int], bool]:
    """``({path: size}, from_disk)``: the cached tree listing, else the hub's, else (offline or
    unreachable) the files of the snapshot on disk."""
    try:
        cached = get_cached_repo_tree(c.repo_id, repo_type=c.repo_type, revision=commit, cache_dir=cache, local_dir=local_dir)
        return {f.path: f.size for f in cached}, offline
    except CachedRepoTreeNotFoundError:
        pass
    if not offline:
        try:
            tree = api.list_repo_tree(c.repo_id, recursive=True, revision=commit, repo_type=c.repo_type)
            return {f.path: f.size for f in tree if isinstance(f, RepoFile)}, False
        except (httpx2.TransportError, OfflineModeIsEnabled):
            if not _on_disk(cache, c, commit, local_dir):
                raise
    base = _on_disk(cache, c, commit, local_dir)
    if base is None:
        raise LocalEntryNotFoundError(f"{c.label} is not in the cache")
    files = {p.relative_to(base).as_posix(): p.stat().st_size for p in base.rglob("*")
             if p.is_file() and p.name != SOURCE_FILE and ".cache" not in p.relative_to(base).parts}
    return files, True


def _on_disk(cache: Path, c: _Context, commit: str, local_dir: Path | None) -> Path | None:
    base = local_dir if local_dir else cache / repo_folder_name(repo_id=c.repo_id, repo_type=c.repo_type) / "snapshots" / commit
    return base if base.is_dir() else None


def download(repo_id: str, *, repo_type: str = "model", revision: str | None = None, fmt: str = "hf",
             weights: str | None = None, allow_patterns: list[str] | str | None = None,
             ignore_patterns: list[str] | str | None = None, subpath: str | None = None,
             local_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
             token: str | bool | None = None, endpoint: str | None = None, pick_data_file: bool = False,
             max_workers: int = 8) -> Snapshot:
    """Download (or find in the cache) a repository snapshot and record its source next to it.

    Args:
        repo_id: ``org/name``.
        repo_type: ``model`` or ``dataset``.
        revision: a branch, tag or commit sha; ``None`` is the default branch.
        fmt: ``hf`` (the HF-format files) or ``meta`` (``original/``'s consolidated checkpoint).
        weights: ``safetensors`` or ``bin`` to pick that copy of the weights; ``None``: safetensors
            when the repository has both.
        allow_patterns, ignore_patterns: glob patterns over the repository's paths; either one given
            replaces the default choice entirely.
        subpath: a file or folder in the repository: only it is fetched, and ``path`` points at it.
        pick_data_file: for a dataset without ``subpath`` or patterns: fetch only its data file
            (the one .json/.jsonl/.parquet file, or the one with "train" in its name) and point
            ``path`` at it; an error names the candidates when that is ambiguous.
        local_dir: download into this directory instead of the cache.
        cache_dir: the hub cache (default ``HF_HUB_CACHE``, ``HF_HOME/hub``).
        token: a hub token; ``None`` uses ``HF_TOKEN`` or the stored login; ``False`` sends none.
        endpoint: the hub's URL (default ``HF_ENDPOINT``, https://huggingface.co).

    Raises:
        HubError: one line: gated repository (with its page's URL), repository/revision/file not
            found, no network, not in the cache when offline, not enough free disk.
    """
    if repo_type not in REPO_TYPES:
        raise HubError(f"repo type {repo_type!r}: expected one of {', '.join(REPO_TYPES)}")
    endpoint = hub_endpoint(endpoint)
    cache = hub_cache_dir(cache_dir).absolute()
    local = Path(local_dir).expanduser().absolute() if local_dir else None
    offline = offline_mode()
    api = HfApi(endpoint=endpoint, token=token)
    token_given = bool(token) if token is not None else bool(_stored_token())
    c = _Context(repo_id, repo_type, revision, endpoint, cache, offline, token_given)
    allow = [allow_patterns] if isinstance(allow_patterns, str) else allow_patterns
    ignore = [ignore_patterns] if isinstance(ignore_patterns, str) else ignore_patterns

    with _hub_errors(c):
        rev = api.resolve_revision(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache, local_files_only=offline)
        commit = rev.resolved
        tree, from_disk = _repo_files(api, c, commit, cache, local, offline)
        label = f"{c.label}" if revision else f"{c.label} (commit {commit[:12]})"
        root = ""
        if subpath:
            subpath = subpath.strip("/")
            if subpath in tree:
                allow, ignore = [subpath], None
            elif any(f.startswith(subpath + "/") for f in tree):
                allow, ignore, root = [subpath + "/*"], None, subpath
            else:
                raise HubError(f"file or folder {subpath} not found in {label}")
        elif allow is None and ignore is None:
            if repo_type == "dataset" and pick_data_file:
                subpath = choose_data_file(list(tree), label)
                allow = [subpath]
            else:
                try:
                    allow, ignore, root = default_patterns(tree, fmt=fmt, weights=weights, repo_type=repo_type)
                except HubError as e:
                    raise HubError(f"{label}: {e}") from None
        elif fmt == "meta":
            root = "original" if any(f.startswith("original/") for f in tree) else ""
        selected = tuple(sorted(filter_repo_objects(list(tree), allow_patterns=allow, ignore_patterns=ignore)))
        if not selected:
            raise HubError(f"no file of {label} matches allow_patterns={allow} ignore_patterns={ignore}")

        base = local or cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type) / "snapshots" / commit
        missing = tuple(p for p in selected if not (base / p).is_file())
        need = sum(tree[p] or 0 for p in missing)
        if missing and not from_disk:
            free = free_disk_bytes(base)
            if need > free:
                raise HubError(f"not enough free disk space for {label}: the {len(missing)} files to fetch need {_size(need)}, "
                               f"{_nearest_existing(base)} has {_size(free)} free; nothing was downloaded (free some space, "
                               "or set HF_HOME or --output-dir to a larger disk)")
        path = snapshot_download(repo_id, repo_type=repo_type, revision=rev, cache_dir=cache, local_dir=local,
                                 allow_patterns=allow, ignore_patterns=ignore, token=token, endpoint=endpoint,
                                 local_files_only=from_disk, max_workers=max_workers)
    root_dir = Path(path)
    record = {"repo_id": repo_id, "repo_type": repo_type, "revision": commit,
              "requested_revision": revision or constants.DEFAULT_REVISION}
    write_source(root_dir, record)
    target = root_dir / subpath if subpath else root_dir / root if root else root_dir
    return Snapshot(path=target, root=root_dir, repo_id=repo_id, repo_type=repo_type, revision=commit,
                    requested_revision=record["requested_revision"], files=selected, fetched=missing,
                    fetched_bytes=need if not from_disk else 0, allow_patterns=allow, ignore_patterns=ignore)


def _stored_token() -> bool:
    from huggingface_hub import get_token

    try:
        return get_token() is not None
    except Exception:  # a broken OIDC setup and the like: we only want to word a message
        return False


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# -- the recorded source ------------------------------------------------------------------
def write_source(directory: Path, record: dict) -> None:
    """Write ``SOURCE_FILE`` in ``directory`` unless it already says the same (the cache may be read-only)."""
    path = Path(directory) / SOURCE_FILE
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    try:
        if path.is_file() and path.read_text() == text:
            return
        tmp = path.with_name(f".{SOURCE_FILE}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not record the source in %s: %s", path, e)


# -- hf:// in configs ---------------------------------------------------------------------
def resolve_hf_uri(uri: str, **kwargs) -> Path:
    """The local path of ``hf://...``, downloading it with the default file choice when needed.

    ``kwargs`` go to ``download`` (cache_dir, token, endpoint, ...)."""
    ref = parse_hf_uri(uri)
    return download(ref.repo_id, repo_type=ref.repo_type, revision=ref.revision, subpath=ref.path,
                    pick_data_file=ref.repo_type == "dataset", **kwargs).path


def resolve_hf_uris(cfg, verbose: bool = True, **kwargs) -> dict[str, Path]:
    """Replace, in place, every string value of ``cfg`` (a DictConfig/ListConfig or dicts and lists)
    that starts with ``hf://`` by its local path; each distinct URI is downloaded once.

    Run it after interpolations are resolved, so ``${checkpointer.checkpoint_dir}`` copies follow.
    Returns ``{uri: local path}``."""
    resolved: dict[str, Path] = {}

    def local(uri: str) -> str:
        if uri not in resolved:
            resolved[uri] = resolve_hf_uri(uri, **kwargs)
            if verbose:
                print(f"{uri} -> {resolved[uri]}", file=sys.stderr, flush=True)
        return str(resolved[uri])

    def visit(node) -> None:
        if _is_mapping(node):
            keys = list(node.keys())
        elif _is_sequence(node):
            keys = list(range(len(node)))
        else:
            return
        for key in keys:
            if _is_missing(node, key):
                continue
            value = node[key]
            if is_hf_uri(value):
                node[key] = local(value)
            else:
                visit(value)

    visit(cfg)
    return resolved


def _is_mapping(node) -> bool:
    return isinstance(node, MutableMapping)


def _is_sequence(node) -> bool:
    return isinstance(node, MutableSequence) and not isinstance(node, (str, bytes))


def _is_missing(node, key) -> bool:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return False
    return isinstance(node, (DictConfig, ListConfig)) and OmegaConf.is_missing(node, key)
