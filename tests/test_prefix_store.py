"""The prefix store: longest-prefix lookup within a salt only, byte and entry bounds, idle TTL, LRU."""

from __future__ import annotations

import pytest

from pfec.common.plan.prefix_store import MAX_SALT_CHARS, PrefixStore


def test_lookup_finds_the_longest_common_prefix_of_the_requests_salt_only() -> None:
    store: PrefixStore[str] = PrefixStore(max_bytes=1000, max_entries=8, ttl_s=60)
    assert store.put("", [1, 2, 3, 9], "branch", 10, now=0)
    assert store.put("", [1, 2, 3, 4, 5], "long", 10, now=0)
    assert store.put("tenant-b", [1, 2, 3, 4, 5, 6, 7], "other tenant", 10, now=0)
    match = store.lookup("", [1, 2, 3, 4, 5, 6, 7, 8], now=1)
    assert match is not None and match.entry.value == "long" and match.tokens == 5
    # A request diverging inside an entry reuses the shared part of it.
    match = store.lookup("", [1, 2, 3, 4, 9], now=1)
    assert match is not None and match.tokens == 4
    # The caller that must compute a token caps what it reuses.
    match = store.lookup("", [1, 2, 3], now=1, max_tokens=2)
    assert match is not None and match.tokens == 2
    assert store.lookup("tenant-c", [1, 2, 3, 4, 5, 6, 7], now=1) is None
    assert store.lookup("", [9, 1, 2], now=1) is None
    assert store.stats.hits == 3 and store.stats.misses == 2 and store.stats.cached_tokens == 11
    assert store.lookup("", [1, 2, 3, 4], now=2, count=False) is not None  # upkeep: not a request
    assert store.lookup("", [7], now=2, count=False) is None
    assert store.stats.hits == 3 and store.stats.misses == 2


def test_a_new_entry_supersedes_the_entries_of_its_salt_it_extends() -> None:
    store: PrefixStore[str] = PrefixStore(max_bytes=1000, max_entries=8, ttl_s=60)
    store.put("a", [1, 2], "turn 1", 10, now=0)
    store.put("b", [1, 2], "other salt", 10, now=0)
    store.put("a", [1, 3], "a branch", 10, now=0)
    store.put("a", [1, 2, 3, 4], "turn 2", 20, now=1)
    assert len(store) == 3 and store.nbytes == 40 and store.stats.superseded == 1
    match = store.lookup("a", [1, 2, 7], now=2)
    assert match is not None and match.entry.value == "turn 2" and match.tokens == 2


def test_byte_budget_and_entry_count_evict_the_least_recently_used() -> None:
    store: PrefixStore[int] = PrefixStore(max_bytes=100, max_entries=3, ttl_s=60)
    for i in range(3):
        store.put("", [i, 100], i, 30, now=i)
    assert store.lookup("", [0, 100, 7], now=5) is not None  # entry 0 used last: 1 is now the oldest
    store.put("", [3, 100], 3, 30, now=6)  # 4 entries > 3: the oldest (1) goes
    assert store.lookup("", [1, 100], now=7) is None and len(store) == 3 and store.nbytes == 90
    store.put("", [4, 100], 4, 70, now=8)  # needs 70 of 100 bytes: two more go
    assert store.nbytes <= 100 and store.lookup("", [4, 100], now=9) is not None
    assert store.stats.evictions == 3
    assert not store.put("", [5], 5, 101, now=9) and store.stats.refused == 1  # larger than the budget


def test_entries_unused_for_the_ttl_expire_and_a_replaced_entry_is_counted_once() -> None:
    store: PrefixStore[str] = PrefixStore(max_bytes=100, max_entries=4, ttl_s=10)
    store.put("s", [1, 2], "a", 40, now=0)
    store.put("s", [1, 2], "b", 50, now=1)  # same tokens: replaced
    assert len(store) == 1 and store.nbytes == 50
    assert store.lookup("s", [1, 2, 3], now=9) is not None  # used: its TTL restarts
    assert store.lookup("s", [1, 2, 3], now=18) is not None
    assert store.lookup("s", [1, 2, 3], now=29) is None and len(store) == 0 and store.nbytes == 0
    assert store.salts() == set()


def test_bad_salts_and_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="bounds"):
        PrefixStore(max_bytes=10, max_entries=1, ttl_s=0)
    store: PrefixStore[str] = PrefixStore(max_bytes=10, max_entries=1, ttl_s=1)
    with pytest.raises(ValueError, match="salt"):
        store.lookup("x" * (MAX_SALT_CHARS + 1), [1], now=0)
