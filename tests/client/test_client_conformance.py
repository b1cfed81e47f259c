"""Specification of :mod:`tiercache.testing.client_conformance`: a fake of the client is told where
it would refuse a call the real client accepts, and a fake that takes every such call passes.

The fakes the tests use are held to it where they live (``tests/connector/test_fakes.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from tiercache.testing.client_conformance import assert_conforms, signature_drift


class Faithful:
    """Takes every call the client's methods of these names take (and adds nothing required)."""

    def release_ticket(self, ticket: int, timeout: float | None = None, *, read: bool = False) -> None: ...

    def poll(self, req_id: int, wait_s: float = 0.0) -> None: ...

    def lookup_async(self, hashes: list[bytes], groups: object, **how: Any) -> int:
        return 1

    def helper_of_its_own(self, anything: int) -> None: ...  # not the client's: not checked


class Drifted:
    def release_ticket(self, ticket: int) -> None: ...  # the client also takes timeout and read=

    def poll(self, request: int, wait_s: float = 0.0) -> None: ...  # the client's is req_id

    def lookup_async(self, hashes: list[bytes], groups: object, tenant: bytes, **how: Any) -> int:
        return 1  # requires what the client only offers


def test_a_fake_that_takes_every_call_of_the_client_conforms() -> None:
    assert signature_drift(Faithful) == []
    assert_conforms(Faithful)


def test_each_way_a_fake_refuses_a_call_the_client_accepts_is_named() -> None:
    assert sorted(signature_drift(Drifted)) == [
        "Drifted.lookup_async: requires 'tenant', which the client does not",
        "Drifted.poll: argument 1 is 'request', the client's 'req_id'",
        "Drifted.poll: requires 'request', which the client does not",
        "Drifted.release_ticket: takes no argument 2 ('timeout')",
        "Drifted.release_ticket: takes no keyword 'read'",
    ]
    with pytest.raises(AssertionError, match="fakes drifted from the client"):
        assert_conforms(Faithful, Drifted)
