"""S3 endpoints on 127.0.0.1 for benchmarks and tools: moto's server mode, or a throwaway Ceph RADOS
Gateway (:mod:`tiercache.testing.rgw`), each torn down when its ``with`` block ends."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The stores :func:`s3_endpoint` can start.
STORES = ("moto", "rgw")


@contextlib.contextmanager
def s3_endpoint(store: str) -> Iterator[str]:
    """An S3 endpoint URL on 127.0.0.1 for ``store`` ("moto" or "rgw"), torn down afterwards.

    RGW's user gets the credentials in ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, so a boto3
    client of this process signs for it. Raises :class:`ValueError` for another store.
    """
    if store == "moto":
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()
    elif store == "rgw":
        from tiercache.testing.rgw import RgwCluster

        directory = Path(tempfile.mkdtemp(prefix="tiercache-bench-rgw-"))
        with RgwCluster(directory, os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]) as c:
            c.start()
            print(f"# rgw up in {c.start_seconds:.1f} s at {c.url}")
            yield c.url
        shutil.rmtree(directory, ignore_errors=True)
    else:
        raise ValueError(f"unknown S3 store {store!r}: use one of {', '.join(STORES)}")
