"""Client API keys, per-key rate limits and concurrency caps.

Keys are stored hashed (SHA-256, hex) with a name: ``name:hexdigest`` per line
in a file, or comma-separated in an environment variable. ``seekserve keys
hash`` prints the line for a secret. A presented bearer token is hashed and
compared with every stored digest using ``hmac.compare_digest``, so the check
takes the same time whichever key matches. Keys never reach the logs: only the
key's name does.

Limits are per ingress replica (in memory): with N ingress replicas a key may
reach N times its rate.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from serve_app.errors import OverloadedError, UnauthorizedError


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def parse_key_lines(text: str) -> dict[str, str]:
    """``name:sha256hex`` entries (newline- or comma-separated) -> {digest: name}."""
    keys: dict[str, str] = {}
    for raw in text.replace(",", "\n").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, digest = line.rpartition(":")
        digest = digest.strip().lower()
        if not sep or not name or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError("each API key entry must be 'name:<64 hex chars of sha256>'")
        keys[digest] = name.strip()
    return keys


@dataclass
class _Bucket:
    tokens: float
    updated_s: float
    in_flight: int = 0


@dataclass
class KeyStore:
    keys: dict[str, str]  # digest -> name
    rate_per_s: float
    burst: int
    max_concurrent: int
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s, replicas: int = 1) -> "KeyStore":
        """With ``replicas`` ingress replicas, each enforces its 1/N share of every
        per-key limit, so that a key gets at most the configured totals across them
        (Serve's proxy spreads requests over the replicas; no shared state per request)."""
        text = ""
        if s.api_keys_file:
            text += Path(s.api_keys_file).expanduser().read_text() + "\n"
        if s.api_keys_env and os.environ.get(s.api_keys_env):
            text += os.environ[s.api_keys_env]
        return cls(parse_key_lines(text), s.rate_limit_per_s / replicas, max(1, s.burst // replicas),
                   max(1, s.max_concurrent_per_key // replicas))

    def authenticate(self, authorization: str | None) -> str:
        """The key's name, or UnauthorizedError (401)."""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
        presented = hash_key(authorization[7:].strip())
        found = None
        for digest, name in self.keys.items():  # no early exit: same work for every key
            if hmac.compare_digest(presented, digest):
                found = name
        if found is None:
            raise UnauthorizedError("the API key is not valid")
        return found

    def acquire(self, name: str, now: float | None = None) -> None:
        """Take one request slot for ``name`` or raise OverloadedError (429)."""
        now = time.monotonic() if now is None else now
        b = self._buckets.get(name)
        if b is None:
            b = self._buckets[name] = _Bucket(tokens=float(self.burst), updated_s=now)
        b.tokens = min(float(self.burst), b.tokens + (now - b.updated_s) * self.rate_per_s)
        b.updated_s = now
        if b.in_flight >= self.max_concurrent:
            raise OverloadedError(f"key {name!r} has {b.in_flight} requests in flight (limit {self.max_concurrent})",
                                  code="concurrency_limit", retry_after_s=1.0)
        if b.tokens < 1.0:
            wait = (1.0 - b.tokens) / self.rate_per_s
            raise OverloadedError(f"key {name!r} is over {self.rate_per_s:g} requests/s",
                                  code="rate_limit", retry_after_s=wait)
        b.tokens -= 1.0
        b.in_flight += 1

    def release(self, name: str) -> None:
        b = self._buckets.get(name)
        if b is not None and b.in_flight > 0:
            b.in_flight -= 1
