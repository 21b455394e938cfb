"""One coded stream to several receivers, sans-IO: ``GroupSession`` (time passed in, bytes out).

Theory of operation
-------------------
One encoder over the shared source symbols; every datagram (SOURCE, REPAIR, the DONE) is sealed once
under the stream's group key (:mod:`pfec.common.wire.group`) and sent once, to the group destination (an
IP multicast group, or a relay that replicates). Each member has its own unicast session for the OFFER,
the ACCEPT, its ACKs and its RESULT (the caller opens those with the member's own keys and hands the
ACKs here: :meth:`GroupSession.on_ack`).

- Repairs serve every member at once. A member's ACK says where its holes lie (decoded prefix, hole map)
  and how many symbols it lacks (its deficit; past the last source, all it has not decoded). What it still
  needs is that less the repairs sent after the packet its ACK covers. The group sends a repair while the
  LARGEST need is positive (never the sum): one repair over the union of the needy members' hole windows,
  with dense coefficients, fills a different hole at each of them.
- The window follows the slowest steering member's prefix; a member that cannot keep up (its measured
  loss above ``max_member_loss``, or its ACKs silent for ``ack_timeout_s``) is dropped with a reason
  (``MemberDropped``): the caller serves it by a unicast session or tells it to compute locally. A member
  that decoded everything stops steering (``MemberComplete``).
- The group is done (a DONE to the group) once every source is out and no steering member lacks anything,
  or the repair cap is spent; at the send deadline it stops.

Phases change only through the tables of :mod:`.states`. The hot path (``next_datagram``) builds no
Python containers: per-packet records are preallocated arrays, a member loop runs over at most 8.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import MAX_DT, Encoder, FecError
from pfec.common.events import Event
from pfec.common.wire.messages import Ack, Done, DoneReason
from pfec.common.wire.seal import PacketProtector
from pfec.sender.transport.fanout.states import (
    GROUP,
    MEMBER,
    GroupEvent,
    GroupPhase,
    MemberEvent,
    MemberPhase,
    Move,
)
from pfec.sender.transport.path import ack_plausible

__all__ = ["MAX_MEMBERS", "GroupConfig", "GroupDone", "GroupSession", "Member", "MemberComplete",
           "MemberDropped"]

MAX_MEMBERS = 8  # receivers of one stream (the API's bound)
# A repair goes while the largest expected shortfall is at least half a symbol: a deficit of one with a
# repair in flight at 7% loss expects 0.07 symbols short, and waits for the ACK rather than repeat it.
NEED_THRESHOLD = 0.5


@dataclass(frozen=True, slots=True)
class GroupConfig:
    budget_s: float  # from start() until the receivers must start decoding
    owd_s: float  # the largest member's one-way delay estimate
    repair_budget: int  # repair datagrams at most, for the whole group
    window_cap: int = 64  # widest repair window (every member's decoder span must hold it)
    max_member_loss: float = 0.3  # a member whose measured loss is above this is dropped
    min_loss_samples: int = 32  # datagrams its ACK must account for before its loss can drop it
    ack_timeout_s: float = 0.5  # a member silent this long while data flows is dropped
    max_control: int = 64  # DONE datagrams and other group control, at most (the packet records' slack)

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.owd_s < 0 or self.owd_s >= self.budget_s:
            raise ValueError("budget_s must be positive and above owd_s >= 0")
        if self.repair_budget < 0:
            raise ValueError(f"repair_budget must be >= 0, got {self.repair_budget!r}")
        if not 1 <= self.window_cap <= 4095:
            raise ValueError(f"window_cap must be in 1..4095, got {self.window_cap!r}")
        if not 0.0 < self.max_member_loss <= 1.0:
            raise ValueError(f"max_member_loss must be in (0, 1], got {self.max_member_loss!r}")
        if self.ack_timeout_s <= 0:
            raise ValueError(f"ack_timeout_s must be positive, got {self.ack_timeout_s!r}")


@dataclass(frozen=True, slots=True)
class MemberDropped(Event):
    member: int
    reason: str


@dataclass(frozen=True, slots=True)
class MemberComplete(Event):
    member: int


@dataclass(frozen=True, slots=True)
class GroupDone(Event):
    """The group will send nothing more: why (a DONE went to the group unless the deadline stopped it)."""

    reason: str
    sources_sent: int
    repairs_sent: int


GroupEventOut = MemberDropped | MemberComplete | GroupDone


class Member:
    """What the group knows of one receiver, from its newest plausible ACK."""

    __slots__ = ("decoded", "deficit", "hole_end", "index", "largest_pn", "last_heard", "lost", "name",
                 "phase", "prefix", "reason", "received", "seen_end")

    def __init__(self, index: int, name: str) -> None:
        self.index, self.name = index, name
        self.phase = MemberPhase.JOINED
        self.prefix = self.seen_end = self.decoded = self.deficit = self.hole_end = 0
        self.largest_pn = self.lost = self.received = 0
        self.last_heard = 0.0
        self.reason = ""

    @property
    def loss(self) -> float:
        total = self.lost + self.received
        return self.lost / total if total else 0.0


class GroupSession:
    """The sending end of one coded fan-out stream (see the module doc). ``sealer``: the stream's group
    protector (:func:`pfec.common.wire.group.group_sealer`); ``members``: a name per receiver (1-8)."""

    def __init__(self, sealer: PacketProtector, symbols: npt.NDArray[np.uint8], config: GroupConfig,
                 members: Sequence[str]) -> None:
        if not 1 <= len(members) <= MAX_MEMBERS:
            raise ValueError(f"a group has 1..{MAX_MEMBERS} members, got {len(members)}")
        if not sealer.has_session_keys:
            raise ValueError("the group sealer must hold the stream's key")
        self.sealer = sealer
        self.config = config
        self.symbols = symbols
        self.encoder = Encoder(symbols, window_cap=config.window_cap, target_nonzeros=None)
        self.n_source = self.encoder.n_source
        self.members = tuple(Member(i, name) for i, name in enumerate(members))
        self.phase = GroupPhase.IDLE
        self._events: deque[GroupEventOut] = deque()
        self._control: deque[bytes] = deque()
        self._out = np.zeros(symbols.shape[1], dtype=np.uint8)  # the repair buffer, reused
        self._out_view = self._out.data
        # Repairs sent before each packet number (indexed by pn): a member's ACK covers its largest_pn.
        self._repairs_at = np.zeros(self.n_source + config.repair_budget + config.max_control + 2, np.int64)
        self.repairs_sent = 0
        self.last_source_pn = 0  # packet number of the last SOURCE (0: not all out)
        self.last_data_pn = 0
        self.bytes_sent = 0
        self.datagrams_sent = {"source": 0, "repair": 0, "control": 0}
        self.drops: dict[str, int] = {}
        self._start = self._send_deadline = 0.0

    # ------------------------------------------------------------------ public API
    def start(self, now: float) -> None:
        self._fire_group(GroupEvent.START, now)

    def next_datagram(self, now: float) -> bytes | None:
        """The next datagram for the group destination, or None with nothing to send now."""
        if self._control:
            return self._sent(self._control.popleft(), "control")
        if not self.phase.sends:
            return None
        if now >= self._send_deadline:
            self._fire_group(GroupEvent.NO_SLOT_LEFT, now, "deadline")
            return self._sent(self._control.popleft(), "control") if self._control else None
        need = self.group_need()
        if need >= NEED_THRESHOLD and self.repairs_sent < self.config.repair_budget:
            datagram = self._repair()
            if datagram is not None:
                return datagram
        if self.encoder.next_esi < self.n_source:
            return self._source()
        if self.repairs_sent >= self.config.repair_budget:
            self._fire_group(GroupEvent.FINISHED, now, DoneReason.BUDGET_SPENT)
        elif need < NEED_THRESHOLD and not any(m.phase.steers and m.decoded < self.n_source
                                               for m in self.members):
            self._fire_group(GroupEvent.FINISHED, now, DoneReason.DECODED)
        return self._sent(self._control.popleft(), "control") if self._control else None

    def on_ack(self, member: int, ack: Ack, now: float) -> bool:
        """One member's ACK, opened under its own session keys: whether the group took it."""
        m = self.members[member]
        if not ack_plausible(ack, self.encoder.next_esi, self.sealer.packets_sealed):
            self._drop("bad_ack")
            return False
        acted = self._fire_member(m, MemberEvent.ACK, now, ack)
        if not m.phase.steers:
            return acted
        if m.decoded >= self.n_source:
            self._fire_member(m, MemberEvent.COMPLETE, now)
        elif m.received >= self.config.min_loss_samples and m.loss > self.config.max_member_loss:
            self._fire_member(m, MemberEvent.LAGGING, now, f"loss {m.loss:.2f} above the group's "
                              f"{self.config.max_member_loss:.2f}")
        self._move_window()
        return acted

    def drop_member(self, member: int, reason: str, now: float) -> None:
        """The caller drops a member (its unicast session failed, it refused): it no longer steers."""
        self._fire_member(self.members[member], MemberEvent.LAGGING, now, reason)
        self._move_window()

    def get_timer(self) -> float | None:
        """When ``handle_timer`` has something to do: the send deadline, or a member going silent."""
        if not self.phase.sends:
            return None
        due = self._send_deadline
        for m in self.members:
            if m.phase.steers:
                due = min(due, m.last_heard + self.config.ack_timeout_s)
        return due

    def handle_timer(self, now: float) -> None:
        if not self.phase.sends:
            return
        for m in self.members:
            if m.phase.steers and now >= m.last_heard + self.config.ack_timeout_s:
                self._fire_member(m, MemberEvent.SILENT, now, f"no ACK for {self.config.ack_timeout_s:.3f} s")
        self._move_window()
        if now >= self._send_deadline:
            self._fire_group(GroupEvent.NO_SLOT_LEFT, now, "deadline")

    def next_event(self) -> GroupEventOut | None:
        return self._events.popleft() if self._events else None

    def need_of(self, m: Member) -> float:
        """What member ``m`` still lacks after the repairs sent since the packet its newest ACK covers,
        each counted at its measured delivery rate (0 for a member that does not steer)."""
        if not m.phase.steers or m.phase is MemberPhase.JOINED:
            return 0.0
        lacking = m.deficit
        if self.last_source_pn and m.largest_pn >= self.last_source_pn:
            lacking = self.n_source - m.decoded  # it has heard past the last source: all it lacks counts
        since = self.repairs_sent - int(self._repairs_at[m.largest_pn])
        return lacking - since * (1.0 - m.loss)

    def group_need(self) -> float:
        """The largest need among the steering members (not the sum: one repair serves each of them)."""
        need = 0.0
        for m in self.members:
            need = max(need, self.need_of(m))
        return need

    @property
    def deadline(self) -> float:
        return self._start + self.config.budget_s

    # ------------------------------------------------------------------ sending
    def _sent(self, datagram: bytes, kind: str) -> bytes:
        self.datagrams_sent[kind] += 1
        self.bytes_sent += len(datagram)
        return datagram

    def _source(self) -> bytes:
        esi = self.encoder.take_source()
        datagram = self.sealer.seal_source(esi, self.symbols[esi].data)
        pn = self.sealer.packets_sealed
        self._repairs_at[pn] = self.repairs_sent
        self.last_data_pn = pn
        if esi + 1 == self.n_source:
            self.last_source_pn = pn
        return self._sent(datagram, "source")

    def repair_window(self) -> tuple[int, int]:
        """(first, count) of the next repair: the union of the needy members' hole windows, capped."""
        first, end = self.n_source, 0
        for m in self.members:
            if self.need_of(m) >= NEED_THRESHOLD:
                first = min(first, m.prefix)
                end = max(end, m.hole_end)
        end = min(end, self.encoder.next_esi, first + self.config.window_cap)
        return first, max(0, end - first)

    def _repair(self) -> bytes | None:
        first, count = self.repair_window()
        if count <= 0:
            return None
        try:  # dense: a coefficient on every symbol of the window, so each member's holes are covered
            rid = self.encoder.make_repair(self._out, count=count, dt=MAX_DT, first=first)
        except FecError:
            self._drop("repair_skipped")
            return None
        datagram = self.sealer.seal_repair(rid.repair_key, rid.dt, rid.nss, rid.fss_esi, self._out_view)
        self.repairs_sent += 1
        pn = self.sealer.packets_sealed
        self._repairs_at[pn] = self.repairs_sent
        self.last_data_pn = pn
        return self._sent(datagram, "repair")

    def _move_window(self) -> None:
        prefixes = [m.prefix for m in self.members if m.phase.steers]
        if prefixes:
            self.encoder.on_ack(min(prefixes))

    # ------------------------------------------------------------------ the tables' actions
    def _fire_group(self, event: GroupEvent, now: float, arg: object = None) -> bool:
        row = GROUP[self.phase][event]
        if not isinstance(row, Move) or not getattr(self, row.action)(now, None, arg):
            return False
        self.phase = row.to  # type: ignore[assignment]  # GROUP's rows move to group phases
        return True

    def _fire_member(self, m: Member, event: MemberEvent, now: float, arg: object = None) -> bool:
        row = MEMBER[m.phase][event]
        if not isinstance(row, Move) or not getattr(self, row.action)(now, m, arg):
            return False
        m.phase = row.to  # type: ignore[assignment]  # MEMBER's rows move to member phases
        return True

    def _begin(self, now: float, _m: None, _arg: object) -> bool:
        self._start = now
        self._send_deadline = now + self.config.budget_s - self.config.owd_s
        for m in self.members:
            m.last_heard = now  # the silence clock runs from the start
        return True

    def _finish(self, now: float, _m: None, reason: object) -> bool:
        assert isinstance(reason, DoneReason)
        done = Done(self.encoder.next_esi, self.repairs_sent, self.last_data_pn, reason)
        self._control.append(self.sealer.seal(done))
        self._events.append(GroupDone(reason.name.lower(), self.encoder.next_esi, self.repairs_sent))
        return True

    def _stop(self, now: float, _m: None, reason: object) -> bool:
        self._events.append(GroupDone(str(reason), self.encoder.next_esi, self.repairs_sent))
        return True

    def _member_ack(self, now: float, m: Member | None, ack: object) -> bool:
        assert m is not None and isinstance(ack, Ack)
        if ack.largest_pn < m.largest_pn:
            return True  # reordered: an older view of the member, nothing to learn
        m.prefix, m.seen_end, m.decoded = ack.decoded_prefix, ack.seen_end, ack.decoded_count
        m.deficit, m.largest_pn, m.lost, m.received = ack.deficit, ack.largest_pn, ack.lost, ack.received
        m.hole_end = _hole_end(ack)
        if self.last_source_pn and ack.largest_pn >= self.last_source_pn:
            m.hole_end = self.n_source  # it lacks the tail too: repairs reach to the end
        m.last_heard = now
        return True

    def _member_complete(self, now: float, m: Member | None, _arg: object) -> bool:
        assert m is not None
        self._events.append(MemberComplete(m.index))
        return True

    def _member_drop(self, now: float, m: Member | None, reason: object) -> bool:
        assert m is not None
        m.reason = str(reason)
        self._events.append(MemberDropped(m.index, m.reason))
        return True

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1


def _hole_end(ack: Ack) -> int:
    """One past the last undecoded ESI the ACK's hole map shows (its prefix when the map is empty)."""
    bits = min(ack.hole_bits, 8 * len(ack.holes))
    if bits <= 0:
        return ack.decoded_prefix if ack.deficit <= 0 else ack.seen_end
    flags = np.unpackbits(np.frombuffer(ack.holes, dtype=np.uint8))[:bits]
    set_bits = np.flatnonzero(flags)
    return ack.decoded_prefix + int(set_bits[-1]) + 1 if len(set_bits) else ack.decoded_prefix

