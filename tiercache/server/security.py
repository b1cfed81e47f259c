"""Transport security: owner-only socket files, ZMQ CURVE, and the shared-secret proof.

* **unix** (default) **and ipc**: the socket lives in the per-user runtime directory, created
  ``0700``; the socket file is ``chmod 0600`` right after bind. Only the server's user can connect
  (on ``unix://`` the kernel's word on each peer is checked too: :mod:`tiercache.server.unix`).
* **tcp + shared secret**: each connection proves the secret with a single-use nonce
  (:mod:`tiercache.wire.auth`, the half both ends share). It authenticates but does not encrypt:
  on an untrusted network use CURVE.
* **tcp + CURVE**: the server's secret key file (``zmq.auth`` format) encrypts every connection;
  clients are admitted only if their public key is in ``authorized_clients/`` beside that file
  (checked by ZAP in the libzmq handshake, so a stranger never reaches the request loop).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from tiercache.config.parts import ServerOptions, default_runtime_dir, runtime_dir_problem
from tiercache.errors import ConfigError, ServerError


def socket_path(endpoint: str) -> Path:
    """The socket file of an ``ipc://`` or ``unix://`` endpoint."""
    return Path(endpoint.removeprefix("ipc://").removeprefix("unix://"))


def prepare_socket(endpoint: str) -> Path:
    """Create the directory of ``endpoint``'s socket file owner-only, clear a stale socket file,
    and return the file's path.

    Raises :class:`ServerError` if a server already listens there (on either scheme).
    """
    path = socket_path(endpoint)
    parent = path.parent
    if not parent.exists() and not parent.is_symlink():
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(parent, 0o700)
    elif parent == default_runtime_dir():
        check_own_directory(parent)
        os.chmod(parent, 0o700)  # our directory: keep it owner-only even if someone loosened it
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ServerError(f"{path} exists and is not a socket; choose another --listen path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ServerError(
                    f"cannot check the socket {path}: {exc}; check the permissions of its directory or choose "
                    "another --listen path"
                ) from exc
            path.unlink(missing_ok=True)  # a crashed server left it behind
        else:
            raise ServerError(
                f"another server is already listening at {path} (asked to listen on {endpoint}); stop it "
                "or use another --listen path"
            )
        finally:
            probe.close()
    return path


def check_own_directory(directory: Path) -> None:
    """Raise :class:`ServerError` unless ``directory`` can be trusted with the socket
    (:func:`~tiercache.config.parts.runtime_dir_problem`)."""
    problem = runtime_dir_problem(directory)
    if problem is not None:
        raise ServerError(problem)


def secure_socket(path: Path) -> None:
    """Make the bound socket owner-only (``0600``)."""
    os.chmod(path, 0o600)


def setup_curve(
    ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], options: ServerOptions
) -> ThreadAuthenticator | None:
    """Turn ``sock`` into a CURVE server with ZAP admission, if the options ask for CURVE."""
    key_file = options.curve_secret_key_file
    if key_file is None:
        return None
    key_file = Path(key_file)
    try:
        public, secret = zmq.auth.load_certificate(key_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read the CURVE secret key file {key_file}: {exc}; create one with "
            "zmq.auth.create_certificates()"
        ) from exc
    if not secret:
        raise ConfigError(f"{key_file} holds no secret key (is it the .key instead of the .key_secret file?)")
    allowed = key_file.parent / "authorized_clients"
    if not allowed.is_dir():
        raise ConfigError(
            f"CURVE needs the public keys of admitted clients in {allowed}/ (one zmq.auth .key file "
            "each); create it"
        )
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(allowed))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth
