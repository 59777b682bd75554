"""Weighted, sticky traffic split across the variants of one served model.

A key (the request's ``user`` or ``x-seekserve-user``) hashes into one of
10,000 buckets with BLAKE2b, which is stable across processes and restarts
(unlike Python's salted ``hash``). Variant ``i`` owns a contiguous range of
buckets sized by its weight, so one user stays on one variant while weights
hold, and moving weight from stable to canary moves only the users in the
buckets that change hands. Requests without a key get a random bucket.

A split is an immutable value; changing weights swaps one reference, so each
request sees either the old split or the new one, never a mix.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

BUCKETS = 10_000


def bucket_of(key: str) -> int:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


@dataclass(frozen=True)
class TrafficSplit:
    model: str
    weights: tuple[tuple[str, int], ...]  # (variant, percent), sums to 100
    version: int = 0

    def __post_init__(self):
        total = sum(w for _, w in self.weights)
        if total != 100:
            raise ValueError(f"weights of {self.model!r} must sum to 100, got {total}")
        if any(w < 0 for _, w in self.weights):
            raise ValueError(f"weights of {self.model!r} must be >= 0")
        names = [v for v, _ in self.weights]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate variants in split of {self.model!r}")

    def variant_for_bucket(self, bucket: int) -> str:
        edge = 0
        for variant, weight in self.weights:
            edge += weight * BUCKETS // 100
            if bucket < edge:
                return variant
        # rounding leftovers go to the last variant with weight
        return next(v for v, w in reversed(self.weights) if w > 0)

    def pick(self, key: str | None) -> str:
        bucket = bucket_of(key) if key else random.randrange(BUCKETS)
        return self.variant_for_bucket(bucket)

    def as_dict(self) -> dict[str, int]:
        return dict(self.weights)


class Router:
    """Holds the current split of every model; reads are lock-free reference loads."""

    def __init__(self, splits: dict[str, TrafficSplit]):
        self._splits = dict(splits)

    def split(self, model: str) -> TrafficSplit | None:
        return self._splits.get(model)

    def set_weights(self, model: str, weights: dict[str, int]) -> TrafficSplit:
        old = self._splits[model]
        unknown = set(weights) - {v for v, _ in old.weights}
        if unknown:
            raise ValueError(f"unknown variants for {model!r}: {sorted(unknown)}")
        new = TrafficSplit(model, tuple((v, int(weights.get(v, 0))) for v, _ in old.weights), old.version + 1)
        splits = dict(self._splits)
        splits[model] = new
        self._splits = splits  # one reference swap: atomic for readers
        return new
