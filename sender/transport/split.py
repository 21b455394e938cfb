"""A split handoff's bookkeeping on the sender (sans-IO): which unsent source symbols the receiver's own
prefill has made worthless, and moving them out of the way.

In a split handoff (``SplitInfo``) the receiver prefills the front of the context itself while the session
streams the back. Every source symbol's stake ends at a context token (the last block any of its pieces
belongs to). An ACK's ``computed_tokens`` says how far the receiver's prefill has got; the not-yet-sent
symbols that hold only computed blocks then move behind the others (a stable partition of the unsent
range) and the source count ends before them, so they are never sent. The receiver files each symbol by
the stream index inside it, so an unsent symbol's ESI may carry any of them; no repair ever covers an
unsent ESI. The meeting point so follows both sides' measured speeds.

Once every symbol the receiver still lacks holds only computed blocks (``needs_nothing``), it has all it
will use: the session is done (a DONE, no more repairs), rather than repairing holes nobody needs until
the RESULT comes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pfec.common.wire.messages import Ack
from pfec.sender.transport.session_types import SplitInfo


class SplitBookkeeping:
    """Each unsent ESI's token end (permuted with the symbols), the receiver's newest ``computed_tokens``,
    and the sources given up because the receiver computed their blocks. Unsplit: inert (``n_tokens`` 0,
    so any ``computed_tokens`` but 0 is out of bounds: the session drops an ACK past ``n_tokens``)."""

    __slots__ = ("computed_tokens", "n_tokens", "source_end", "sources_dropped", "symbols", "token_end")

    def __init__(self, split: SplitInfo | None, symbols: npt.NDArray[np.uint8]) -> None:
        n_source = len(symbols)
        self.token_end: npt.NDArray[np.int64] | None = None
        if split is not None:
            if len(split.token_end_of_esi) != n_source:
                raise ValueError(f"split: {len(split.token_end_of_esi)} token ends for "
                                 f"{n_source} source symbols")
            self.token_end = np.array(split.token_end_of_esi, dtype=np.int64)
            symbols = symbols.copy()  # its unsent rows get reordered: a copy of its own, the caller's stays
        self.symbols = symbols  # the rows the session sends (and encodes from)
        self.n_tokens = 0 if split is None else split.n_tokens
        self.computed_tokens = 0
        self.source_end = n_source  # the end of the sources still worth sending
        self.sources_dropped = 0  # unsent sources never sent: the receiver computed their blocks

    def on_computed(self, computed: int, first_unsent: int) -> npt.NDArray[np.intp] | None:
        """The receiver has prefilled [0, ``computed``) itself. Moves the unsent symbols [first_unsent,
        source_end) whose blocks all lie below ``computed`` behind the others and ends ``source_end``
        before them; returns the ESIs in their new order (for the session's other per-ESI rows), or None
        when nothing moved (a repeated or reordered value, or no symbol's end passed)."""
        if computed <= self.computed_tokens:
            return None
        self.computed_tokens = computed
        ends = self.token_end
        if ends is None:
            return None
        first, end = first_unsent, self.source_end
        unsent = ends[first:end]
        keep = unsent > computed
        kept = int(np.count_nonzero(keep))
        if kept == len(unsent):
            return None
        order = np.concatenate((np.flatnonzero(keep), np.flatnonzero(~keep))) + first
        self.symbols[first:end] = self.symbols[order]
        ends[first:end] = ends[order]
        self.sources_dropped += len(unsent) - kept
        self.source_end = first + kept
        return order

    def needs_nothing(self, ack: Ack, sent: int) -> bool:
        """Whether every source worth sending is out (``sent``: the next ESI) and each one this ACK does not
        report decoded holds only blocks the receiver computed: its hole map over [prefix, prefix +
        hole_bits), and every ESI after that (not seen yet: in flight or lost). False unsplit, or before
        any computed tokens."""
        ends = self.token_end
        if ends is None or self.computed_tokens == 0 or sent < self.source_end:
            return False
        first = ack.decoded_prefix
        needed = ends[first:sent] > self.computed_tokens  # each undecoded one of these is still needed
        mapped = min(ack.hole_bits, len(needed))
        if mapped:
            holes = np.unpackbits(np.frombuffer(ack.holes, dtype=np.uint8), count=mapped)  # MSB first
            needed[:mapped] &= holes.astype(np.bool_)
        return not bool(needed.any())
