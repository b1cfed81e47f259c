"""Specification: a session's seal takes each message of its own session once, in order, and nothing else."""

from __future__ import annotations

import os

from tiercache.wire.auth import TAG_BYTES, SessionSeal, session_key


def pair() -> tuple[SessionSeal, SessionSeal]:
    key = session_key("secret", os.urandom(32), os.urandom(16))
    return SessionSeal(key, to_server=True), SessionSeal(key, to_server=False)


def test_a_sealed_message_opens_once_on_the_other_end() -> None:
    client, server = pair()
    tag = client.seal(b"request")
    assert len(tag) == TAG_BYTES
    assert server.open(b"request", tag)
    assert not server.open(b"request", tag)  # the same message again: a replay


def test_an_older_message_is_refused_after_a_newer_one() -> None:
    client, server = pair()
    first, second = client.seal(b"one"), client.seal(b"two")
    assert server.open(b"two", second)
    assert not server.open(b"one", first)


def test_a_changed_message_or_tag_is_refused() -> None:
    client, server = pair()
    tag = client.seal(b"put key=a")
    assert not server.open(b"put key=b", tag)
    assert not server.open(b"put key=a", tag[:-1] + bytes([tag[-1] ^ 1]))
    assert not server.open(b"put key=a", tag[:8])  # short
    assert server.open(b"put key=a", tag)  # the untouched message still opens


def test_a_tag_never_verifies_in_the_other_direction_or_another_session() -> None:
    client, server = pair()
    assert not client.open(b"reply", client.seal(b"reply"))  # a request's tag is not a reply's
    other_client, _ = pair()
    assert not server.open(b"request", other_client.seal(b"request"))


def test_session_keys_differ_with_either_nonce_and_the_secret() -> None:
    nonce, mine = os.urandom(32), os.urandom(16)
    key = session_key("secret", nonce, mine)
    assert key == session_key("secret", nonce, mine)
    assert (
        len(
            {
                key,
                session_key("secret", os.urandom(32), mine),
                session_key("secret", nonce, os.urandom(16)),
                session_key("other", nonce, mine),
            }
        )
        == 4
    )
