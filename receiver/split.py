"""A split handoff's bookkeeping on the receiving side (sans-IO): what the stream must still bring.

In a split the application computes the context's front itself (``ReceiverSession.set_split`` and
``set_computed``). A symbol is needed while its token end (``stream.symbol_token_ends``, by the stream
index in its first 4 bytes) lies past the tokens computed here; the session is ready once every needed
symbol is decoded and the front is computed, or once the whole context is computed.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pfec.common.codec.gf256 import njit_cached
from pfec.common.plan.prefill import meeting_chunk_end

__all__ = ["SplitProgress", "warm_up"]


class SplitProgress:
    """The tokens computed here, and which stream indices are decoded and still needed (a session that is
    not a split keeps one with ``n_tokens`` 0)."""

    __slots__ = ("computed", "ends", "front", "have", "missing_needed", "n_tokens")

    def __init__(self) -> None:
        self.n_tokens = 0  # the context's length; 0: not a split
        self.front = 0  # the front [0, front) no symbol carries
        self.computed = 0  # context tokens [0, computed) computed here
        # Token end and decoded flag per stream index (None: the plan not known yet), and how many needed
        # indices are still missing (-1: not known).
        self.ends: npt.NDArray[np.int64] | None = None
        self.have: npt.NDArray[np.bool_] | None = None
        self.missing_needed = -1

    def plan(self, token_end_of_index: npt.NDArray[np.int64] | None, n_tokens: int, front: int,
             n_source: int) -> bool:
        """Set the split (see ``ReceiverSession.set_split``); True when its token ends are known."""
        if not 0 < n_tokens <= 0xFFFF_FFFF or not 0 <= front <= n_tokens:
            raise ValueError(f"split: a front of {front!r} tokens in a context of {n_tokens!r}")
        self.n_tokens = n_tokens
        self.front = front
        if token_end_of_index is None:
            return False
        ends = np.asarray(token_end_of_index, dtype=np.int64)
        if ends.ndim != 1 or len(ends) != n_source:
            raise ValueError(f"split: {ends.shape} token ends for {n_source} source symbols")
        self.ends = ends
        self.have = np.zeros(len(ends), dtype=np.bool_)
        return True

    def check_computed(self, tokens: int) -> None:
        if not 0 <= tokens <= self.n_tokens:
            raise ValueError(f"computed tokens {tokens!r} outside the context 0..{self.n_tokens}")

    def file(self, store: npt.NDArray[np.uint8], esis: npt.NDArray[np.int64]) -> None:
        """Newly decoded ESIs -> their stream indices (the first 4 bytes of the symbol), marked decoded."""
        have, ends = self.have, self.ends
        if have is None or ends is None or len(esis) == 0:
            return
        needed = _file_stream_indices(store, esis, have, ends, self.computed)
        if self.missing_needed > 0:
            self.missing_needed -= needed

    def count_missing(self) -> None:
        have, ends = self.have, self.ends
        if have is not None and ends is not None:
            self.missing_needed = int(np.count_nonzero(~have & (ends > self.computed)))

    def ready(self, decoded_all: bool) -> bool:
        """The front computed here, and what is still needed decoded (or the whole context computed)."""
        computed = self.computed
        front_done = computed >= self.front
        return computed >= self.n_tokens or (front_done and (decoded_all or self.missing_needed == 0))

    def chunk_end(self, done: int, end: int, seconds_per_token: float, decoded: int,
                  first_data_at: float | None, now: float) -> int:
        """Where the front's chunk from ``done`` meets the stream (``prefill.meeting_chunk_end``), at the
        rate it has delivered ``decoded`` symbols since ``first_data_at``; ``end`` while that is unknown."""
        have, ends = self.have, self.ends
        if have is None or ends is None or first_data_at is None or now <= first_data_at or decoded == 0:
            return end
        missing = np.sort(ends[~have])
        return meeting_chunk_end(done, end, seconds_per_token, missing, decoded / (now - first_data_at))


@njit_cached
def _file_stream_indices(store: npt.NDArray[np.uint8], esis: npt.NDArray[np.int64],
                         have: npt.NDArray[np.bool_], ends: npt.NDArray[np.int64], computed: int) -> int:
    """Mark the stream index each decoded row of ``esis`` carries (its first 4 bytes, big-endian) in
    ``have``, once (an index outside it is ignored: an authenticated sender's bug); returns how many newly
    marked indices end past ``computed`` (no longer missing and needed). Compiled: it runs per datagram."""
    needed = 0
    for k in range(esis.shape[0]):
        row = esis[k]
        idx = (np.int64(store[row, 0]) << 24) | (np.int64(store[row, 1]) << 16) | (
            np.int64(store[row, 2]) << 8) | np.int64(store[row, 3])
        if idx < have.shape[0] and not have[idx]:
            have[idx] = True
            if ends[idx] > computed:
                needed += 1
    return needed


def warm_up() -> None:
    """Compile (or load from numba's cache) the split's filing kernel before any datagram needs it."""
    store = np.zeros((2, 8), dtype=np.uint8)
    _file_stream_indices(store, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.bool_),
                         np.ones(1, dtype=np.int64), 0)
