"""Reading record files: ``.json`` (a list of records), ``.jsonl`` (one a line) and ``.parquet``.

Each record comes back with the file it is in and where it is there (``record 3 (line 4)``), so that a
dataset that checks it can say exactly which one is wrong in a one-line error. The source is a file, or a
directory holding such files (e.g. a dataset repository the config layer resolved from ``hf://datasets/...``
to a local snapshot): its data files are read in name order, each numbering its own records. ``converted`` is how
the datasets read them: each record converted (rendered, tokenized) as it is read, a bad one stopping the run in one
line or, with ``skip_bad_records``, counted out.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from waypoint.text.chat_template import ChatTemplateLimitError

SUFFIXES = (".json", ".jsonl", ".parquet")
JSON_DEPTH = 900  # levels of [ and { a data file may nest (a record needs a handful); deeper is refused in one line
# JSON files a dataset directory holds beside its data (datasets' save_to_disk and the Hub's metadata).
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}


class Record(NamedTuple):
    """One record as read: ``file`` it came from, ``where`` in that file (for messages), its ``data``."""

    file: Path
    where: str
    data: Any


def column_names(columns: Mapping[str, str] | None, keys: Sequence[str]) -> dict[str, str]:
    """A dataset's ``columns`` option (other field names for ``keys``) as a dict; a ValueError naming the keys it
    takes where it names another key or a name that is not a non-empty string."""
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(keys))
    if unknown or not all(isinstance(v, str) and v for v in columns.values()):
        raise ValueError(f"columns: expected names for {', '.join(keys)}, got {columns!r}")
    return columns


def read_records(source: str | Path) -> list[Record]:
    """The records of a data file, or of every data file in a directory (sorted by path)."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES and p.name not in METADATA_FILES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise FileNotFoundError(f"{path}: no data files in the directory (looked for {', '.join(SUFFIXES)})")
        return [record for file in files for record in read_file(file)]
    return read_file(path)


class Skipped:
    """The records ``converted`` left out (``skip_bad_records``): how many, and the first one's error line."""

    def __init__(self) -> None:
        self.count, self.first = 0, None


def converted(source: str | Path, convert: Callable[[Record, str], Any], skip_bad_records: bool,
              skipped: Skipped) -> Iterator[tuple[str, Any]]:
    """``(where, convert(record, where))`` for each record of ``source``, ``where`` naming its file and record. A
    record ``convert`` refuses (``ValueError``: malformed, or refused by the chat template) stops the run in one line
    naming it, or with ``skip_bad_records`` is counted in ``skipped``; a template that runs past its limits is the
    template's fault, not the record's, and is never skipped."""
    for record in read_records(source):
        where = f"{record.file}: {record.where}"
        try:
            result = convert(record, where)
        except ChatTemplateLimitError as e:
            raise ValueError(f"{where}: {e}") from e
        except ValueError as e:
            error = str(e) if str(e).startswith(where) else f"{where}: {e}"
            if not skip_bad_records:
                raise ValueError(error) from e
            skipped.count += 1
            skipped.first = skipped.first or error
            continue
        yield where, result


def read_file(path: Path) -> list[Record]:
    """The records of one ``.json``, ``.jsonl`` or ``.parquet`` file, numbered from 1."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: dataset file not found")
    if path.suffix == ".parquet":
        return [Record(path, f"record {n}", data) for n, data in enumerate(read_parquet(path), start=1)]
    if path.suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: unsupported dataset file type {path.suffix!r} (expected .json, .jsonl or .parquet)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                         f"a {path.suffix} data file is UTF-8 JSON (a binary file named {path.suffix}?)") from e
    if path.suffix == ".jsonl":
        records = []
        with json_depth_bounded():
            for line_no, line in enumerate(text.split("\n"), start=1):
                if line.strip():
                    data = parse_json(path, line, f"line {line_no}: ")
                    records.append(Record(path, f"record {len(records) + 1} (line {line_no})", data))
        return records
    with json_depth_bounded():
        data = parse_json(path, text, "")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    return [Record(path, f"record {n}", item) for n, item in enumerate(data, start=1)]


def read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(f"{path}: reading parquet needs pyarrow (pip install 'waypoint[parquet]')") from e
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own error types
        raise ValueError(f"{path}: unreadable parquet file ({str(e).splitlines()[0]})") from e


def parse_json(path: Path, text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {where}invalid JSON ({e})") from e
    except RecursionError:  # json's parser recurses once per level of [ or {
        raise ValueError(f"{path}: {where}JSON nested too deeply to read (past about {JSON_DEPTH} levels of [ and {{); "
                         "a dataset record is an object a few levels deep: check the file") from None


@contextlib.contextmanager
def json_depth_bounded() -> Iterator[None]:
    """Within the block, json's parser stops at about ``JSON_DEPTH`` levels with a RecursionError. Up to Python 3.11
    its C parser recurses as deep as the interpreter's recursion limit lets it, and a program that raised the limit
    (``sys.setrecursionlimit(10**6)``) would have it overflow the C stack on a file nested 200,000 deep: the
    interpreter dies (SIGSEGV), no error to report. So the limit is lowered to this frame's depth plus
    ``JSON_DEPTH`` for the parse (never raised), and put back after."""
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    limit = sys.getrecursionlimit()
    wanted = depth + JSON_DEPTH + 50
    if limit <= wanted:
        yield
        return
    sys.setrecursionlimit(wanted)
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)
