"""Tenant isolation: the salt the router derives from a request's API key (docs/operating.md, "Tenant isolation").

A prefix-cache hit is faster than a miss, so on a shared pool a client can learn whether someone else
sent a prompt by timing its own request. Salting a request's block hashes (engine/kv/hashing.py) confines
its hits to requests with the same salt. Two salts apply, both optional and both part of the hash root:

- ``cache_salt``, sent by the client (vLLM's field, on both HTTP endpoints and on gRPC);
- with ``router.salt_by_api_key``, a tenant salt derived here from the API key the request came with,
  so every key is its own cache domain whatever its clients send.

The tenant salt is ``sha256(b"duet-tenant-salt/v1" ‖ 0x00 ‖ key)`` as 32 hex characters: the key itself
never leaves the front door (the salt travels to the workers inside ``SamplingParams``, kept out of its
repr; KV events carry only block hashes). It is a plain hash, not a keyed one, so that router replicas
sharing workers derive the same salt for a key without sharing one more secret; API keys are
high-entropy secrets already (a guessable key is broken at the front door), so the salt does not help
anyone recover one.
"""
from __future__ import annotations

import hashlib

_LABEL = b"duet-tenant-salt/v1\x00"


def tenant_salt(api_key: str) -> str:
    """The tenant salt of ``api_key`` (equal keys, equal salts; any other key, another salt)."""
    if not isinstance(api_key, str) or not api_key:
        raise ValueError("an API key is a non-empty string")
    return hashlib.sha256(_LABEL + api_key.encode()).hexdigest()[:32]


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (HTTP header or gRPC metadata); None when
    the value is not a bearer credential."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def metadata_bearer(metadata) -> str | None:
    """The bearer token of the first ``authorization`` entry of gRPC metadata ((key, str | bytes) pairs); None:
    none, or not a bearer credential."""
    for key, value in metadata:
        if key == "authorization":
            return bearer_token(value.decode() if isinstance(value, bytes) else value)
    return None
