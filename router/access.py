"""Who may change the server (the operator's writes: pool targets, LoRA adapters), the one rule both front doors
apply (router/http/admin.py documents it for HTTP; gRPC's LoRA RPCs follow it too, router/grpc/lora.py):

- with an admin key configured (``--admin-key``): that key, sent as ``Authorization: Bearer <key>``; none sent is
  "unauthenticated" (HTTP 401, gRPC UNAUTHENTICATED), any other key, an API key included, "forbidden" (403,
  PERMISSION_DENIED);
- without one: writes only on a server bound to a loopback address (the embedded default, 127.0.0.1), and then under
  the read rule (with API keys configured, one of them; else open); on any other bind "forbidden", with a hint.
Keys are compared in constant time. Pure: no web framework here.
"""
from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Denied:
    unauthenticated: bool  # True: no (valid) credential at all; False: a credential that may not write
    message: str
    code: str  # the OpenAI-style error code the HTTP door sends


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _matches(given: bytes | None, keys: Sequence[bytes]) -> bool:
    return given is not None and any(hmac.compare_digest(given, k) for k in keys)


def read_denied(token: str | None, api_keys: Sequence[str], admin_key: str | None) -> Denied | None:
    """The read rule: with API keys, one of them or the admin key; else open."""
    keys = [k.encode() for k in (*api_keys, *([admin_key] if admin_key else []))]
    if api_keys and not _matches(token.encode() if token else None, keys):
        return Denied(True, "invalid or missing API key (send 'Authorization: Bearer <key>')", "invalid_api_key")
    return None


def write_denied(token: str | None, api_keys: Sequence[str], admin_key: str | None,
                 bind_host: str) -> Denied | None:
    """Why the bearer ``token`` may not change the server, or None if it may."""
    if admin_key is None:
        if not is_loopback(bind_host):
            return Denied(False, "admin writes are disabled: this server is not bound to a loopback address and has "
                          "no admin key (start it with --admin-key)", "admin_disabled")
        return read_denied(token, api_keys, admin_key)  # a write never needs less than a read
    if token is None:
        return Denied(True, "admin key required (send 'Authorization: Bearer <admin key>')", "missing_admin_key")
    if not _matches(token.encode(), [admin_key.encode()]):
        return Denied(False, "this key may not change the server (the admin key is required)", "not_admin")
    return None
