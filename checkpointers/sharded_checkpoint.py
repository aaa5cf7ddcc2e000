"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards.

A step directory of a multi-process run keeps its model and optimizer tensors in
``sharded/`` (DCP's ``__<rank>_<n>.distcp`` files and ``.metadata``), beside
``recipe_state.pt`` and the manifest. DCP reshards on load, so a checkpoint written by
N processes resumes on M.

DCP pickles its metadata and would unpickle any non-tensor entry with
``weights_only=False``. A checkpoint is data, never code: only tensors are saved here
(the rest travels in ``recipe_state.pt``), and the metadata is read by an unpickler that
knows DCP's few plain-data classes for tensors and nothing else: a checkpoint declaring
a pickled non-tensor entry (``BytesStorageMetadata``) is refused with the rest.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from waypoint.errors import CheckpointError

SHARDED_DIR = "sharded"
DCP_ERRORS = (Exception, CheckpointException)  # DCP's CheckpointException derives from BaseException
METADATA_FILE = ".metadata"

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata(directory: str | Path) -> Metadata:
    """A sharded checkpoint's metadata, unpickled safely; one-line errors naming the file."""
    path = Path(directory) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a sharded checkpoint)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable sharded checkpoint metadata ({e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of its ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank metadata files are not supported")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def tensors_only(state: Mapping[str, Any], where: str = "state") -> dict[str, Any]:
    """``state`` (nested dicts) checked to hold tensors only."""
    out = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            out[key] = tensors_only(value, f"{where}.{key}")
        elif isinstance(value, torch.Tensor):
            out[key] = value
        else:
            raise CheckpointError(f"{where}.{key}: a {type(value).__name__}; sharded checkpoints hold tensors only")
    return out


def describe_error(e: BaseException) -> str:
    """One line for a failed save or load; DCP's CheckpointException names each rank's failure: the first one."""
    if isinstance(e, CheckpointException) and getattr(e, "failures", None):
        failure = sorted(e.failures.items(), key=lambda item: item[0])[0][1]
        e = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack) in some versions
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{text} ({type(e).__name__})" if text else type(e).__name__


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def save_sharded(state: Mapping[str, Any], directory: str | Path, group=None, asynchronous: bool = False):
    """Write ``state`` (nested dicts of tensors and DTensors) into ``directory``; every rank calls this.

    Returns None, or with ``asynchronous`` the future of the write: the tensors are copied
    to CPU memory before this returns, and training may change them at once.
    """
    state = tensors_only(state)
    if not state:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(str(directory), sync_files=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        if asynchronous:  # (one process saves synchronously: nothing to overlap with)
            if not _distributed():
                dcp.save(state, storage_writer=writer, no_dist=True)
                return None
            return dcp.async_save(state, storage_writer=writer, process_group=group)
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=not _distributed())
    return None


def load_sharded(state: dict[str, Any], directory: str | Path, group=None) -> None:
    """Fill ``state``'s tensors (plain or DTensors, any sharding) in place from ``directory``."""
    read_metadata(directory)  # refuses unsafe or odd metadata with a one-line error before DCP reads it
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(tensors_only(state), storage_reader=SafeFileSystemReader(str(directory)), process_group=group,
                     no_dist=not _distributed())
    except CheckpointError:
        raise
    except DCP_ERRORS as e:  # DCP wraps per-rank failures in its own exception types
        raise CheckpointError(f"{directory}: cannot load sharded checkpoint: {describe_error(e)}") from e


def sharded_keys(directory: str | Path) -> set[str]:
    """The flattened keys (``model.layers.0...``, ``optimizer...``) a sharded checkpoint holds."""
    return set(read_metadata(directory).state_dict_metadata)


def holds_sharded_model(step_dir: str | Path) -> bool:
    """Whether a step directory keeps its model in DCP shards (an intermediate checkpoint of a multi-process run)."""
    directory = Path(step_dir) / SHARDED_DIR
    return (directory / METADATA_FILE).is_file() and any(k.startswith("model.") for k in sharded_keys(directory))


def rank_files(directory: str | Path, rank: int) -> list[Path]:
    """The files ``rank`` wrote into ``directory`` (rank 0 also wrote the metadata)."""
    directory = Path(directory)
    files = sorted(directory.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (directory / METADATA_FILE).is_file():
        files.append(directory / METADATA_FILE)
    return files
