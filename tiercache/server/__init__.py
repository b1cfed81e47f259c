"""The tiercache server: owns the tiers of one node and serves :mod:`tiercache.protocol` over ZMQ.

Use :class:`Server` programmatically (the CLI's ``tiercache server`` wraps it)::

    server = Server(engine, ServerOptions(listen="ipc:///run/user/1000/tiercache/server.sock"))
    server.start()          # bind + background loop thread
    ...
    server.stop(timeout=10)  # stop accepting, drain, flush, close the tiers
"""

from tiercache.server.core import Server
from tiercache.server.records import EvictionNote, EvictionRecord

__all__ = ["EvictionNote", "EvictionRecord", "Server"]
