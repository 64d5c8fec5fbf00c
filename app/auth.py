"""The API key, checked alike by every front end: ``Authorization: Bearer <key>`` over HTTP,
the same as ``authorization`` call metadata over gRPC."""

from __future__ import annotations

import hmac

from pydantic import SecretStr


def authorized(authorization: str | None, key: SecretStr | None) -> bool:
    """Whether ``authorization`` (the header's or the metadata's value) carries ``key``; always
    with no key set. The comparison takes the same time for every wrong key, and a missing
    value is as wrong as any other (the settings refuse an empty key)."""
    if key is None:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    expected = key.get_secret_value().encode()
    return bool(given) and hmac.compare_digest(given, expected)
