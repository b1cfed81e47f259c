"""The tiercache server: owns the tiers of one node and serves :mod:`tiercache.wire.protocol` over a Unix socket or ZMQ.

Run it from a configuration with :func:`run` (``tiercache server`` does), or drive :class:`Server`
programmatically::

    engine = build_engine(ServerConfig.load())
    server = Server(engine, ServerOptions(listen="unix:///run/user/1000/tiercache/server.sock"))
    server.start()          # bind + background loop thread
    ...
    server.stop(timeout=10)  # stop accepting, drain, flush, close the tiers

The rooms: :mod:`~tiercache.server.app` (transport, dispatch, lifecycle), :mod:`~tiercache.server.sessions`
(clients, what they hold, the handshake), :mod:`~tiercache.server.data_ops` and
:mod:`~tiercache.server.management_ops` (the requests), :mod:`~tiercache.server.layouts` (registered
engine layouts), :mod:`~tiercache.server.security` (socket permissions, CURVE),
:mod:`~tiercache.server.records` (recent evictions), :mod:`~tiercache.server.metrics` (Prometheus),
:mod:`~tiercache.server.build` (tiers and engine from a config) and :mod:`~tiercache.server.run`.
"""

from tiercache.server.app import Server
from tiercache.server.build import build_engine
from tiercache.server.run import run

__all__ = ["Server", "build_engine", "run"]
