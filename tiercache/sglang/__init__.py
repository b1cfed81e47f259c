"""tiercache as an SGLang HiCache storage backend: ``TierCacheStorage``.

Load it with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tiercache",
        "module_path": "tiercache.sglang", "class_name": "TierCacheStorage",
        "interface_v1": 1, "server": "unix:///run/tiercache/server.sock"}'

Importing this package is cheap: SGLang and torch are imported only when ``TierCacheStorage`` is
first accessed (SGLang's factory does that when it loads the backend). The settings
(:mod:`tiercache.sglang.settings`) and the page keys (:mod:`tiercache.sglang.keys`) work without SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercache.sglang.storage import TierCacheStorage

__all__ = ["TierCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "TierCacheStorage":
        from tiercache.sglang.storage import TierCacheStorage

        return TierCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
