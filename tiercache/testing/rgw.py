"""A throwaway single-node Ceph cluster whose RADOS Gateway serves S3 on 127.0.0.1, for tests.

One monitor, one OSD on ``memstore`` (RAM), one ``radosgw`` with the ``beast`` front end; no cephx,
pool size 1, ports chosen free, everything (config, data, pid files, logs) under one directory. The
daemons run in the foreground as children of this process, so teardown is "terminate the pids". The
Debian packages (``radosgw ceph-mon ceph-osd``) must be installed; :func:`missing_programs` says which
are not. Settings and their reasons: ``../shared/reference/ceph-rgw-on-one-machine.md``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

#: The programs a bring-up runs, all from the Debian packages ``ceph-mon``, ``ceph-osd``, ``radosgw``.
PROGRAMS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "ceph-authtool", "monmaptool")
#: The packages that provide them.
PACKAGES = ("radosgw", "ceph-mon", "ceph-osd")


class RgwError(RuntimeError):
    """The cluster could not be brought up; the message names the step and the log to read."""


def missing_programs() -> list[str]:
    """The Ceph programs not on PATH (empty: a cluster can be brought up here)."""
    return [name for name in PROGRAMS if shutil.which(name) is None]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RgwCluster:
    """A running cluster: ``url`` answers S3 with ``access_key``/``secret_key``. Use as a context
    manager, or call :meth:`close`; :meth:`stop_gateway`/:meth:`start_gateway` stage an S3 outage."""

    directory: Path
    access_key: str
    secret_key: str
    mon_port: int = field(default_factory=free_port)
    rgw_port: int = field(default_factory=free_port)
    start_seconds: float = 0.0
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    @property
    def conf(self) -> Path:
        return self.directory / "ceph.conf"

    def log(self, name: str) -> Path:
        """The log file of daemon ``name`` (``mon.a``, ``osd.0``, ``client.rgw``)."""
        return self.directory / "log" / f"{name}.log"

    def _write_conf(self, fsid: str) -> None:
        d = self.directory
        self.conf.write_text(
            f"""[global]
fsid = {fsid}
mon_host = v2:127.0.0.1:{self.mon_port}
mon_initial_members = a
ms_bind_msgr1 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
ms_mon_client_mode = crc
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
osd_crush_chooseleaf_type = 0
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
mon_max_pg_per_osd = 1000
paxos_propose_interval = 0.1
run_dir = {d}/run
admin_socket = {d}/run/$name.asok
pid_file = {d}/run/$name.pid
log_file = {d}/log/$name.log
mon_data = {d}/mon/$name
osd_data = {d}/osd/$name
osd_objectstore = memstore
memstore_device_bytes = 2147483648
keyring = {d}/keyring

[client.rgw]
rgw_frontends = beast endpoint=127.0.0.1:{self.rgw_port} tcp_nodelay=1
rgw_data = {d}/rgw
auth_client_required = none
ms_mon_client_mode = crc
"""
        )

    def _run(self, *args: str, timeout: float = 60) -> str:
        try:
            done = subprocess.run(
                [*args, "-c", str(self.conf)], capture_output=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RgwError(
                f"{args[0]} {' '.join(args[1:3])} ran past {timeout} s; logs in {self.directory}/log"
            ) from exc
        if done.returncode != 0:
            raise RgwError(
                f"{' '.join(args)} failed (exit {done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}"
                f"; logs in {self.directory}/log"
            )
        return done.stdout.decode()

    def _daemon(self, name: str, *args: str) -> None:
        out = (self.directory / "log" / f"{name}.stdout").open("ab")
        # -f: foreground, so the process is our child and terminating it is the whole teardown.
        self._procs[name] = subprocess.Popen([*args, "-f", "-c", str(self.conf)], stdout=out, stderr=out)
        out.close()

    def start(self, timeout: float = 120) -> None:
        """Bring the cluster up and create the S3 user; raises :class:`RgwError` saying which step failed."""
        began = time.monotonic()
        for sub in ("run", "log", "mon", "osd", "rgw"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        fsid = str(uuid.uuid4())
        self._write_conf(fsid)
        keyring = str(self.directory / "keyring")
        self._run(
            "ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.", "--cap", "mon", "allow *"
        )
        monmap = str(self.directory / "monmap")
        self._run(
            "monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]", monmap
        )
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", keyring)
        self._daemon("mon.a", "ceph-mon", "-i", "a")
        osd_uuid = str(uuid.uuid4())
        osd_id = self._run("ceph", "osd", "new", osd_uuid, timeout=timeout).strip()
        (self.directory / "osd" / f"osd.{osd_id}").mkdir()  # memstore writes its fsid file there
        self._run("ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        self._daemon(f"osd.{osd_id}", "ceph-osd", "-i", osd_id)
        self.start_gateway(timeout=timeout)
        self._run(
            "radosgw-admin", "user", "create", "--uid=tiercache", "--display-name=tiercache",
            f"--access-key={self.access_key}", f"--secret-key={self.secret_key}", timeout=timeout,
        )  # fmt: skip
        self.start_seconds = time.monotonic() - began

    def start_gateway(self, timeout: float = 120) -> None:
        """Start radosgw (again) and wait until it answers HTTP."""
        self._daemon("client.rgw", "radosgw", "-n", "client.rgw")
        deadline = time.monotonic() + timeout
        while True:
            proc = self._procs["client.rgw"]
            if proc.poll() is not None:
                raise RgwError(f"radosgw exited ({proc.returncode}); see {self.log('client.rgw')}")
            try:
                urllib.request.urlopen(self.url, timeout=2).read()
                return
            except urllib.error.HTTPError:
                return  # it answered: an S3 error for an anonymous request is an answer
            except OSError:
                if time.monotonic() > deadline:
                    raise RgwError(
                        f"radosgw did not answer on {self.url} within {timeout} s; see {self.log('client.rgw')}"
                    ) from None
                time.sleep(0.1)

    def stop_gateway(self) -> None:
        """Stop radosgw (the monitor and OSD keep the data); :meth:`start_gateway` brings it back."""
        self._stop("client.rgw")

    def _stop(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop every daemon, gateway first (the directory, logs included, is the caller's)."""
        for name in sorted(self._procs, key=lambda n: (not n.startswith("client"), n)):
            self._stop(name)

    def __enter__(self) -> RgwCluster:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
