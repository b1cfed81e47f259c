"""Shared fixtures: a controllable clock, payload helpers and an S3 endpoint over real HTTP."""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from tiercache.testing.fixtures import FakeClock, make_key, payload_for
from tiercache.testing.rgw import PACKAGES, RgwCluster, RgwError, missing_programs

__all__ = ["FakeClock", "S3Endpoint", "make_key", "payload_for"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    region: str = "us-east-1"
    #: "moto" (moto's server mode) or "rgw" (Ceph's RADOS Gateway).
    kind: str = "moto"
    cluster: RgwCluster | None = None

    def reset(self) -> None:
        """Drop every bucket and object, keeping the server up."""
        if self.kind == "moto":
            req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
            urllib.request.urlopen(req, timeout=10).read()
            return
        # A real store has no reset API: empty and delete each bucket through S3 itself.
        client = boto3.session.Session().client("s3", endpoint_url=self.url, region_name=self.region)
        try:
            for bucket in client.list_buckets().get("Buckets", ()):
                name = bucket["Name"]
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                    keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                    if keys:  # RGW refuses more than 1000 per request; a page holds at most 1000
                        client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
                client.delete_bucket(Bucket=name)
        finally:
            client.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Endpoint]:
    """moto's S3 server on 127.0.0.1, spoken to over real HTTP by boto3 (never patched)."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Endpoint(f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3Endpoint) -> Iterator[S3Endpoint]:
    """The session's S3 endpoint, emptied before each test."""
    s3_server.reset()
    yield s3_server


@pytest.fixture(scope="session")
def rgw_server(s3_server: S3Endpoint) -> Iterator[S3Endpoint]:
    """A throwaway Ceph cluster's RADOS Gateway on 127.0.0.1 (tiercache.testing.rgw), with the same
    credentials the moto fixture put in the environment. Skipped where the Ceph packages are missing,
    except in CI (CI=true), where a missing or broken cluster fails."""
    missing = missing_programs()
    in_ci = os.environ.get("CI") == "true"
    if missing:
        message = f"Ceph's RADOS Gateway is not installed (missing {', '.join(missing)}); install it with `apt-get install -y --no-install-recommends {' '.join(PACKAGES)}`"
        if in_ci:
            pytest.fail(message)
        pytest.skip(message)
    directory = Path(tempfile.mkdtemp(prefix="tiercache-rgw-"))
    cluster = RgwCluster(directory, os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    try:
        cluster.start()
    except RgwError:
        cluster.close()
        raise  # the directory (logs) is kept: the message names it
    print(f"\nrgw: cluster up in {cluster.start_seconds:.1f} s at {cluster.url} ({directory})")
    try:
        yield S3Endpoint(cluster.url, kind="rgw", cluster=cluster)
    finally:
        cluster.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["moto", "rgw"])
def s3_any(request: pytest.FixtureRequest) -> Iterator[S3Endpoint]:
    """The one parametrised S3 endpoint: each test that takes it runs on moto and on Ceph RGW,
    emptied before the test. Modules opt in by naming it (tests/l3_s3 does, as ``s3``)."""
    endpoint: S3Endpoint = request.getfixturevalue("s3_server" if request.param == "moto" else "rgw_server")
    endpoint.reset()
    yield endpoint
