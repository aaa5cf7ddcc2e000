"""Upload and download speed of a step checkpoint through the object-store commit protocol, against an S3 API on
127.0.0.1 (moto's server, as in the tests; ``--endpoint URL`` for another S3-compatible store, with its credentials
in the environment).

    python benchmarks/bench_object_store.py [--size-gb 1.0] [--files 4] [--endpoint http://...]

Prints the upload (files, then the manifest last), the commit check (manifest + listed sizes) and the download
(every hash verified) of a step of ``--size-gb`` in ``--files`` files, with their throughput; and, for a sharded
(torchrun) step of the same size on one rank, DCP's own ``FsspecWriter`` straight to the store (no hashes, no
manifest) against what the savers do (DCP to the local mirror, hashed, committed, then uploaded). moto keeps objects
in its own Python process's memory, so the loopback figures measure the client and that server, not a real store.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT))  # tests.s3_server: the loopback server the tests use


def sharded_save(url: str, work: Path, total: int) -> tuple[float, float]:
    """Seconds for a one-rank DCP save of ``total`` bytes: DCP's FsspecWriter to ``url``; DCP to a local staged
    step, hashed and committed, then uploaded through the commit protocol."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from waypoint.checkpointers.commit import StagedDir, hash_file
    from waypoint.run.object_store import ObjectStore
    from waypoint.checkpointers.sharded_checkpoint import save_sharded

    rows = max(1, total // (4096 * 4 * 16))
    state = {f"w{i}": torch.randn(rows, 4096) for i in range(16)}
    start = time.perf_counter()
    dcp.save(state, storage_writer=FsspecWriter(f"{url}/direct/sharded", sync_files=False), no_dist=True)
    direct = time.perf_counter() - start
    start = time.perf_counter()
    with StagedDir(work / "sharded_step" / "step_1") as stage:
        save_sharded(state, stage.path / "sharded", group=None, asynchronous=False)
        for p in (stage.path / "sharded").iterdir():
            stage.adopt(f"sharded/{p.name}", *hash_file(p))
    ObjectStore(url).upload(work / "sharded_step" / "step_1")
    return direct, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--endpoint", help="an S3-compatible endpoint (default: moto's server on 127.0.0.1)")
    parser.add_argument("--bucket", help="with --endpoint: an existing bucket to write under bench/ (then removed)")
    args = parser.parse_args()

    from waypoint.checkpointers.commit import StagedDir
    from waypoint.run.object_store import ObjectStore
    from tests.s3_server import new_bucket, s3_server

    work = Path(tempfile.mkdtemp(prefix="bench_object_store_"))
    try:
        step = work / "step_1"
        per_file = int(args.size_gb * 1e9 / args.files)
        with StagedDir(step) as stage:
            for i in range(args.files):
                stage.write_bytes(f"model-{i + 1:05d}-of-{args.files:05d}.safetensors", os.urandom(per_file))
        total = per_file * args.files
        with (nullcontext(args.endpoint) if args.endpoint else s3_server()) as endpoint:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            bucket = args.bucket or new_bucket()
            store = ObjectStore(f"s3://{bucket}/bench")
            t0 = time.perf_counter()
            store.upload(step)
            up = time.perf_counter() - t0
            t0 = time.perf_counter()
            checked = store.check("step_1")
            check = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = store.download("step_1", work / "copy")
            down = time.perf_counter() - t0
            assert checked.ok and got.ok, (checked.problem, got.problem)
            store.delete("step_1")
            direct, ours = sharded_save(f"s3://{bucket}/bench-dcp", work, total)
        print(f"step of {total / 1e9:.2f} GB in {args.files} files, {'endpoint ' + args.endpoint if args.endpoint else 'moto on 127.0.0.1'}")
        print(f"upload (files, then MANIFEST.json)   {up:7.2f} s  {total / 1e6 / up:7.0f} MB/s")
        print(f"commit check (manifest + sizes)      {check:7.3f} s")
        print(f"download (every hash verified)       {down:7.2f} s  {total / 1e6 / down:7.0f} MB/s")
        print(f"sharded step, DCP FsspecWriter direct {direct:7.2f} s  {total / 1e6 / direct:7.0f} MB/s  (no hashes, no manifest)")
        print(f"sharded step, mirror + upload        {ours:7.2f} s  {total / 1e6 / ours:7.0f} MB/s  (hashed, committed, manifest last)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
