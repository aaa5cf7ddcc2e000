"""A real S3 API on 127.0.0.1 for the tests: moto's standalone server, started on a free port and stopped by the
fixture; the real s3fs/boto3 clients reach it through ``AWS_ENDPOINT_URL``. Nothing leaves the loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_SESSION_TOKEN": "testing", "NO_PROXY": "127.0.0.1", "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server(timeout_s: float = 30.0):
    """Yields the endpoint URL (``http://127.0.0.1:PORT``) with the AWS environment pointing at it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        os.environ.update(ENV | {"AWS_ENDPOINT_URL": endpoint})
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        server.wait(timeout=10)


def new_bucket() -> str:
    """A fresh bucket on the server the environment points at."""
    import boto3

    name = f"wp-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return name
