"""What the SGLang backend tests share: a real tiercache server in its own process, and backends built
by SGLang's own factory around a host pool. Imported only after ``sglang`` was found importable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tests.server.serverproc import ServerProcess, ServerSpec
from tests.sglang.hostpool import MHALayoutHostPool

#: Tokens per SGLang page, and so the server's chunk size.
PAGE = 4
MiB = 1 << 20


def server_spec(directory: Path, *, disk: bool = True, **kw: Any) -> ServerSpec:
    """A server on an ipc socket in ``directory``, with an LMDB disk tier under it unless told not."""
    kw.setdefault("options", {"chunk_size": PAGE})
    return ServerSpec(
        listen=f"ipc://{directory}/server.sock",
        l1_bytes=8 * MiB,
        disk_path=str(directory / "l2") if disk else None,
        **kw,
    )


@contextmanager
def running(spec: ServerSpec) -> Iterator[ServerProcess]:
    """A started, ready server process, stopped on exit."""
    proc = ServerProcess(spec)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def storage_config(
    endpoint: str, *, tp_rank: int = 0, tp_size: int = 1, model: str = "tiny/model", **extra: Any
) -> HiCacheStorageConfig:
    """What SGLang's cache controller hands a storage backend, pointing the dynamic factory at us."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model,
        extra_config={
            "backend_name": "tiercache",
            "module_path": "tiercache.sglang",
            "class_name": "TierCacheStorage",
            "interface_v1": 1,
            "server": endpoint,
            "timeout_s": 5.0,
            "weights_id": "w1",
            **extra,
        },
    )


def backend(endpoint: str, pool: MHALayoutHostPool, **config: Any) -> HiCacheStorage:
    """A backend built as SGLang builds one (``StorageBackendFactory.create_backend("dynamic")``),
    with the host pool registered the way its cache controller does."""
    cfg = storage_config(endpoint, **config)
    made = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    made.register_mem_pool_host(pool)
    return made


def keys(n: int, tag: str = "p") -> list[str]:
    """``n`` SGLang-style page keys (64 hex digits, as its SHA-256 chain gives)."""
    import hashlib

    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]
