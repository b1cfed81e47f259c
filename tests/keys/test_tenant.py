"""Tenant ids: a stable digest of the cache salt that names a tenant without revealing it."""

from __future__ import annotations

import pytest

from tiercache.errors import KeyFormatError
from tiercache.keys.tenant import DEFAULT_TENANT, check_tenant, parse_tenant, tenant_id, tenant_label


def test_requests_without_a_salt_belong_to_the_default_tenant() -> None:
    assert tenant_id(None) == tenant_id("") == DEFAULT_TENANT
    assert tenant_label(DEFAULT_TENANT) == "default"
    assert parse_tenant("default") == DEFAULT_TENANT


def test_a_salt_gives_the_same_eight_byte_id_everywhere_and_the_label_does_not_contain_it() -> None:
    acme = tenant_id("acme-secret-salt")
    assert len(acme) == 8 and acme == tenant_id("acme-secret-salt")
    assert acme != tenant_id("acme-secret-salt ") and acme != tenant_id("other")
    label = tenant_label(acme)
    assert len(label) == 16 and "acme" not in label
    assert parse_tenant(label.upper()) == acme


@pytest.mark.parametrize("text", ["acme", "0123", "zz" * 8, ""])
def test_anything_but_sixteen_hex_digits_or_default_is_refused_with_the_fix(text: str) -> None:
    with pytest.raises(KeyFormatError, match="tiercache tenant-id"):
        parse_tenant(text)


def test_ids_off_the_wire_are_empty_or_eight_bytes() -> None:
    assert check_tenant(b"") == b""
    assert check_tenant(b"12345678") == b"12345678"
    with pytest.raises(KeyFormatError, match="8 bytes"):
        check_tenant(b"123")
