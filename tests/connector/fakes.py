"""Stand-ins for what the connector's halves talk to, handed in through their ``link`` seam."""

from __future__ import annotations

from typing import Any

from tiercache.client.link import LinkFactory, OnConnect
from tiercache.config.connector import ConnectorSettings


class FakeLink:
    """A link that is up with ``client`` (or down with ``None``) and records what failed."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.outages = 0
        self.failures: list[str] = []

    def start(self) -> bool:
        return self._client is not None

    def client(self) -> Any:
        return self._client

    def failed(self, what: str, exc: BaseException) -> None:
        self.failures.append(what)

    def close(self) -> None:
        pass


def link_to(client: Any) -> LinkFactory:
    """The ``link`` argument of a half whose server is ``client``."""

    def factory(settings: ConnectorSettings, name: str, on_connect: OnConnect) -> FakeLink:
        return FakeLink(client)

    return factory
