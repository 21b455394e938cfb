"""A bounded store of prefix caches, keyed by (cache salt, token ids): what lets a request that starts with
tokens a node already holds (a handed-off context, an earlier turn of the conversation) skip their prefill.

Pure data structure (sans-IO): time is passed in, the values are opaque (the model glue's caches), their
sizes are told by the caller. On a GPU node the caches are device tensors and the byte budget is device
memory (``device_budget_error`` checks it against the GPU's free memory at start-up). Bounded four ways:
a byte budget, an entry count, an idle TTL, and LRU eviction when a new entry needs room. ``lookup``
finds, among the entries of the request's own salt only (as vLLM's prefix cache isolates tenants), the
one sharing the longest common prefix with the request's tokens; a caller may reuse that many tokens of
it (cropped), never another salt's.

One owner: the daemons touch a store only from their model worker thread (every job there runs in turn),
so nothing here locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

V = TypeVar("V")
#: The longest cache salt a client may give (vLLM's ``cache_salt`` is a free string; ours is bounded).
MAX_SALT_CHARS = 256


@dataclass
class Entry(Generic[V]):
    """One stored prefix: its tokens, the cache over them, its size and where it came from."""

    salt: str
    ids: npt.NDArray[np.int64]
    value: V
    nbytes: int
    last_used: float
    info: Mapping[str, Any] = field(default_factory=dict)  # e.g. the handoff it was rebuilt from

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Match(Generic[V]):
    """A lookup's answer: the entry and how many of the request's first tokens it holds."""

    entry: Entry[V]
    tokens: int


@dataclass
class StoreStats:
    """Counters the daemons export as metrics (read them; only the store writes them)."""

    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0  # tokens served from entries instead of prefilled
    evictions: int = 0  # entries dropped for room, entry count or TTL
    superseded: int = 0  # entries dropped because a new one of their salt starts with all their tokens
    refused: int = 0  # entries larger than the whole budget, never stored


def common_prefix(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixStore(Generic[V]):
    """Prefix caches by (salt, token ids), at most ``max_bytes`` and ``max_entries``, each dropped once
    unused for ``ttl_s``; the least recently used goes first when room is needed."""

    def __init__(self, max_bytes: int, max_entries: int, ttl_s: float) -> None:
        if max_bytes < 0 or max_entries < 0 or ttl_s <= 0:
            raise ValueError(f"bad prefix store bounds: {max_bytes} bytes, {max_entries} entries, "
                             f"ttl {ttl_s} s")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[str, bytes], Entry[V]] = OrderedDict()  # LRU first
        self.nbytes = 0
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(salt: str, ids: npt.NDArray[np.int64]) -> tuple[str, bytes]:
        return salt, ids.tobytes()

    def put(self, salt: str, ids: Sequence[int], value: V, nbytes: int, now: float,
            info: Mapping[str, Any] | None = None) -> bool:
        """Store ``value`` (the cache over ``ids``, ``nbytes`` large) under ``salt``, replacing an entry of
        the same tokens and evicting the least recently used as needed; False when it is larger than the
        whole budget (or the store holds nothing) and is not stored."""
        _check_salt(salt)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.expire(now)
        if nbytes > self.max_bytes or self.max_entries == 0 or not len(ids):
            self.stats.refused += 1
            return False
        array = np.asarray(ids, dtype=np.int64).copy()
        key = self._key(salt, array)
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._supersede(salt, array)
        while self._entries and (self.nbytes + nbytes > self.max_bytes
                                 or len(self._entries) >= self.max_entries):
            self._evict_oldest()
        self._entries[key] = Entry(salt, array, value, nbytes, now, dict(info or {}))
        self.nbytes += nbytes
        return True

    def lookup(self, salt: str, ids: Sequence[int], now: float, max_tokens: int | None = None,
               count: bool = True) -> Match[V] | None:
        """The entry of ``salt`` sharing the longest common prefix with ``ids`` (at most ``max_tokens`` of
        it counted: a caller that must compute at least one token passes ``len(ids) - 1``), marked used;
        None (a miss) when no entry of this salt shares a token. Counts the hit or miss (unless ``count``
        is false: the node's own upkeep, not a request)."""
        _check_salt(salt)
        self.expire(now)
        request = np.asarray(ids, dtype=np.int64)
        limit = len(request) if max_tokens is None else max(0, min(max_tokens, len(request)))
        best: tuple[int, tuple[str, bytes]] | None = None
        for key, entry in self._entries.items():
            if entry.salt != salt:
                continue
            shared = min(common_prefix(entry.ids, request), limit)
            if shared > 0 and (best is None or shared > best[0]):
                best = (shared, key)
        if best is None:
            self.stats.misses += count
            return None
        shared, key = best
        entry = self._entries[key]
        entry.last_used = now
        self._entries.move_to_end(key)
        if count:
            self.stats.hits += 1
            self.stats.cached_tokens += shared
        return Match(entry, shared)

    def _supersede(self, salt: str, ids: npt.NDArray[np.int64]) -> None:
        """Drop the entries of ``salt`` whose tokens all begin ``ids``: the new entry shares at least as
        long a prefix with any request as they do (a conversation's next turn replaces its last)."""
        covered = [k for k, e in self._entries.items()
                   if e.salt == salt and e.n_tokens <= len(ids) and common_prefix(e.ids, ids) == e.n_tokens]
        for key in covered:
            self.nbytes -= self._entries.pop(key).nbytes
        self.stats.superseded += len(covered)

    def expire(self, now: float) -> int:
        """Drop every entry unused for ``ttl_s``; returns how many went."""
        stale = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s]
        for key in stale:
            self.nbytes -= self._entries.pop(key).nbytes
        self.stats.evictions += len(stale)
        return len(stale)

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        self.stats.evictions += 1

    def salts(self) -> set[str]:
        """The salts with at least one entry (to tell a client its salt matches nothing)."""
        return {e.salt for e in self._entries.values()}


def device_budget_error(budget_bytes: int, free_bytes: int, total_bytes: int, device: str) -> str | None:
    """Why a store of ``budget_bytes`` cannot live on ``device`` (a GPU: its caches are device memory, as
    ``nbytes`` counts them), given the device's free and total memory once the model is loaded; None
    when it fits."""
    if budget_bytes <= free_bytes:
        return None
    mib = 1 << 20
    return (f"limits.prefix_cache_bytes = {budget_bytes / mib:.0f} MiB does not fit {device}: on a GPU the "
            f"prefix cache store lives in device memory, and {free_bytes / mib:.0f} MiB of its "
            f"{total_bytes / mib:.0f} MiB are free with the model loaded; lower limits.prefix_cache_bytes")


def _check_salt(salt: str) -> None:
    if not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS:
        raise ValueError(f"cache salt: expected a string of at most {MAX_SALT_CHARS} characters")
