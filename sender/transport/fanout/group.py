"""One coded stream to several receivers, sans-IO: ``GroupSession`` (time passed in, bytes out).

Theory of operation
-------------------
One encoder over the shared source symbols; every datagram (SOURCE, REPAIR, the DONE) is sealed once
under the stream's group key (:mod:`pfec.common.wire.group`) and sent once, to the group destination (an
IP multicast group, or a relay that replicates). Each member has its own unicast session for the OFFER,
the ACCEPT, its ACKs and its RESULT (the caller opens those with the member's own keys and hands the
ACKs here: :meth:`GroupSession.on_ack`).

- Repairs serve every member at once. Each member's ACKs feed its own repair planner
  (:class:`pfec.sender.transport.repair_plan.RepairPlanner`, the unicast session's): its holes grouped into
  regions of at most ``window_cap`` symbols, each region's share of its reported deficit (the shares add
  up to it), and every group repair the ACK has not seen charged to the region of that member it reaches
  (a repair planned for another member counts only where its window covers this member's holes). The
  group sends a repair while the LARGEST outstanding need among the members is at least half a symbol
  (never the sum), over the neediest region of the neediest member widened over the other needy members'
  neediest regions that fit beside it within the cap, with dense coefficients: it fills a different hole
  at each member whose holes lie in that window. Repairs in flight count as arriving until a lost one could no
  longer be replaced before the deadline (``RESEND_RTTS`` of the member's RTT), then at its loss.
- The window follows the slowest steering member's prefix; a member that cannot keep up (its measured
  loss above ``max_member_loss`` by more than its sampling error, ``LOSS_MARGIN``, or its ACKs silent for
  ``ack_timeout_s``) is dropped with a reason (``MemberDropped``): the caller serves it by a unicast
  session or tells it to compute locally. A member that decoded everything stops steering
  (``MemberComplete``).
- The group is done (a DONE to the group) once every source is out and no steering member lacks anything,
  or the repair cap is spent; at the send deadline it stops.

Phases change only through the tables of :mod:`.states`. The hot path (``next_datagram``) builds no
Python containers: per-packet records are preallocated arrays, a member loop runs over at most 8, and a
member's plan is made again only after its ACK or a repair (sources change no plan).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import MAX_DT, Encoder, FecError
from pfec.common.events import Event
from pfec.common.wire.messages import MAX_HOLE_BITS, Ack, Done, DoneReason
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
from pfec.sender.transport.repair_plan import RESEND_RTTS, SEEN_MIN_S, SEEN_RTTS, RepairPlanner

__all__ = ["MAX_MEMBERS", "GroupConfig", "GroupDone", "GroupSession", "Member", "MemberComplete",
           "MemberDropped"]

MAX_MEMBERS = 8  # receivers of one stream (the API's bound)
MAX_SPAN = MAX_HOLE_BITS  # an ACK's hole map reaches at most this far past the prefix
# A repair goes while the largest expected shortfall is at least half a symbol: a deficit of one with a
# repair in flight at 7% loss expects 0.07 symbols short, and waits for the ACK rather than repeat it.
NEED_THRESHOLD = 0.5
# A member is dropped for its loss once it exceeds max_member_loss by LOSS_MARGIN / sqrt(datagrams its ACK
# accounts for). Measured on bursty paths (Gilbert-Elliott, bad runs of ten at 50%, 300 runs, an ACK
# every 16): 15% mean loss crosses 0.3 at some ACK from 32 datagrams on in 23% of runs, 0.3 + 1.5 / sqrt(n)
# in 1.3%; Bernoulli 60% is dropped at 32 datagrams, 40% at about 190.
LOSS_MARGIN = 1.5
RTT_GAIN = 0.125  # a member's smoothed RTT moves by this share of each sample (RFC 6298's alpha)
# A member with holes that has not ACKed for PROBE_RTTS smoothed RTTs (at least PROBE_MIN_S) is overdue:
# the repairs in flight to it count as lost and one goes again, so a lost last repair provokes an ACK
# instead of a silence that drops the member (a tail-loss probe, as the solo session's).
PROBE_RTTS = 2.0
PROBE_MIN_S = 0.02


@dataclass(frozen=True, slots=True)
class GroupConfig:
    budget_s: float  # from start() until the receivers must start decoding
    owd_s: float  # the largest member's one-way delay estimate
    repair_budget: int  # repair datagrams at most, for the whole group
    window_cap: int = 64  # widest repair window (every member's decoder span must hold it)
    span: int = 0  # how far past a member's prefix its ACK may report holes (its decoder span; 0: window_cap)
    max_member_loss: float = 0.3  # a member whose measured loss is above this is dropped
    min_loss_samples: int = 32  # datagrams (received and lost) its ACK must account for before a drop
    ack_timeout_s: float = 0.5  # a member silent this long while data flows is dropped
    max_control: int = 64  # DONE datagrams and other group control, at most (the packet records' slack)

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.owd_s < 0 or self.owd_s >= self.budget_s:
            raise ValueError("budget_s must be positive and above owd_s >= 0")
        if self.repair_budget < 0:
            raise ValueError(f"repair_budget must be >= 0, got {self.repair_budget!r}")
        if not 1 <= self.window_cap <= 4095:
            raise ValueError(f"window_cap must be in 1..4095, got {self.window_cap!r}")
        if not 0 <= self.span <= MAX_SPAN:
            raise ValueError(f"span must be in 0..{MAX_SPAN}, got {self.span!r}")
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

    __slots__ = ("decoded", "deficit", "first", "hole_end", "index", "largest_pn", "last_heard", "lossy",
                 "lost", "name", "need", "nss", "phase", "planner", "prefix", "probed_at", "reason",
                 "received", "rtt", "seen_end", "stale")

    def __init__(self, index: int, name: str, planner: RepairPlanner) -> None:
        self.index, self.name = index, name
        self.phase = MemberPhase.JOINED
        self.prefix = self.seen_end = self.decoded = self.deficit = self.hole_end = 0
        self.largest_pn = self.lost = self.received = 0
        self.last_heard = self.rtt = self.probed_at = 0.0
        self.reason = ""
        self.planner = planner  # its holes in regions, the repairs charged to them
        # Its newest plan: outstanding need, the neediest region's window; ``stale`` until made again.
        self.need, self.first, self.nss = 0.0, 0, 0
        self.stale = True
        self.lossy = False  # repairs in flight count at its loss (too late to replace a lost one)

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
        span = max(config.window_cap, config.span or config.window_cap)
        self.members = tuple(Member(i, name, RepairPlanner(config.window_cap, span, None, fill_deficit=True))
                             for i, name in enumerate(members))
        self.phase = GroupPhase.IDLE
        self._events: deque[GroupEventOut] = deque()
        self._control: deque[bytes] = deque()
        self._out = np.zeros(symbols.shape[1], dtype=np.uint8)  # the repair buffer, reused
        self._out_view = self._out.data
        # Per packet number (a member's ACK covers its largest_pn): the repairs and sources sent up to it,
        # and when it was sent (its RTT sample).
        packets = self.n_source + config.repair_budget + config.max_control + 2
        self._repairs_at = np.zeros(packets, np.int64)
        self._sources_at = np.zeros(packets, np.int64)
        self._sent_at = np.zeros(packets, np.float64)
        # Per repair: its window [first, end) and when it went (the members' planners read them).
        self._rep_window = np.zeros((config.repair_budget + 1, 2), np.int64)
        self._rep_time = np.zeros(config.repair_budget + 1, np.float64)
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
        neediest = self._neediest(now)
        need = 0.0 if neediest is None else neediest.need
        if neediest is not None and need >= NEED_THRESHOLD and self.repairs_sent < self.config.repair_budget:
            datagram = self._repair(neediest, now)
            if datagram is not None:
                return datagram
        if self.encoder.next_esi < self.n_source:
            return self._source(now)
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
        elif self._lagging(m):
            self._fire_member(m, MemberEvent.LAGGING, now, f"loss {m.loss:.2f} above the group's "
                              f"{self.config.max_member_loss:.2f}")
        self._move_window()
        return acted

    def _lagging(self, m: Member) -> bool:
        """Whether member ``m``'s measured loss is above the group's bound by more than the sampling error
        of the datagrams its ACK accounts for (``LOSS_MARGIN`` over their square root)."""
        n = m.received + m.lost
        cfg = self.config
        return n >= cfg.min_loss_samples and m.loss > cfg.max_member_loss + LOSS_MARGIN / n**0.5

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

    def need_of(self, m: Member, now: float | None = None) -> float:
        """What member ``m`` still lacks in its reported holes after the group repairs that reach them
        (sent since the packet its newest ACK covers, each counted as its planner counts it): 0 for a
        member that does not steer or has not ACKed yet. ``now``: the time (default: the start)."""
        if not m.phase.steers or m.phase is MemberPhase.JOINED:
            return 0.0
        self._plan_member(m, self._start if now is None else now)
        return m.need

    def group_need(self, now: float | None = None) -> float:
        """The largest need among the steering members (not the sum: one repair serves each of them)."""
        m = self._neediest(self._start if now is None else now)
        return 0.0 if m is None else max(0.0, m.need)

    @property
    def deadline(self) -> float:
        return self._start + self.config.budget_s

    # ------------------------------------------------------------------ sending
    def _sent(self, datagram: bytes, kind: str) -> bytes:
        self.datagrams_sent[kind] += 1
        self.bytes_sent += len(datagram)
        return datagram

    def _source(self, now: float) -> bytes:
        esi = self.encoder.take_source()
        datagram = self.sealer.seal_source(esi, self.symbols[esi].data)
        pn = self.sealer.packets_sealed
        self._repairs_at[pn] = self.repairs_sent
        self._sources_at[pn] = esi + 1
        self._sent_at[pn] = now
        self.last_data_pn = pn
        if esi + 1 == self.n_source:
            self.last_source_pn = pn
        return self._sent(datagram, "source")

    def repair_window(self, now: float | None = None) -> tuple[int, int]:
        """(first, count) of the next repair: the neediest region of the neediest member, widened over the
        other needy members' ((0, 0): none)."""
        m = self._neediest(self._start if now is None else now)
        if m is None or m.need < NEED_THRESHOLD:
            return 0, 0
        first, end = self._widened(m)
        return first, end - first

    def _plan_member(self, m: Member, now: float) -> None:
        """Make member ``m``'s plan again if an ACK or a repair changed it, or its repairs in flight now
        count at its loss (a lost one could no longer be replaced in time)."""
        lossy = m.rtt > 0 and self._send_deadline - now < RESEND_RTTS * m.rtt
        overdue = (m.rtt > 0 and m.decoded < self.n_source
                   and now - max(m.last_heard, m.probed_at) > max(PROBE_RTTS * m.rtt, PROBE_MIN_S))
        if not (m.stale or overdue or lossy != m.lossy):
            return
        m.lossy, m.stale = lossy, False
        if overdue:  # its repairs in flight count as lost until the probe this plan sends is answered
            m.probed_at = now
        plan = m.planner.plan(self.encoder.next_esi, 1.0 if overdue else m.loss if lossy else 0.0)
        if plan.region < 0 or plan.nss <= 0:
            m.need, m.first, m.nss = min(0.0, plan.reactive_need), 0, 0
        else:
            m.need, m.first, m.nss = plan.reactive_need, plan.first, plan.nss
        if overdue and m.need < NEED_THRESHOLD:  # no reported hole: it may lack a tail its ACKs never saw
            end = self.encoder.next_esi
            first = max(m.prefix, self.encoder.ack_prefix, end - self.config.window_cap)
            if first < end:
                m.need, m.first, m.nss = 1.0, first, end - first

    def _neediest(self, now: float) -> Member | None:
        """The steering member whose outstanding need is the largest (None: none has ACKed)."""
        best: Member | None = None
        for m in self.members:
            if not m.phase.steers or m.phase is MemberPhase.JOINED:
                continue
            self._plan_member(m, now)
            if best is None or m.need > best.need:
                best = m
        return best

    def _widened(self, m: Member) -> tuple[int, int]:
        """(first, end) of the repair for member ``m``'s neediest region, widened over every other needy
        member's neediest region that fits within the window cap beside it: one repair, a hole at each."""
        first, end = m.first, m.first + m.nss
        cap = self.config.window_cap
        for other in self.members:
            if other is m or other.nss <= 0 or other.need < NEED_THRESHOLD or not other.phase.steers:
                continue
            lo, hi = min(first, other.first), max(end, other.first + other.nss)
            if hi - lo <= cap:
                first, end = lo, hi
        return first, end

    def _repair(self, m: Member, now: float) -> bytes | None:
        first, end = self._widened(m)
        count = end - first
        if count <= 0 or first < self.encoder.ack_prefix or end > self.encoder.next_esi:
            m.stale = True
            return None
        try:  # dense: a coefficient on every symbol of the window, so each member's holes are covered
            rid = self.encoder.make_repair(self._out, count=count, dt=MAX_DT, first=first)
        except FecError:
            self._drop("repair_skipped")
            return None
        datagram = self.sealer.seal_repair(rid.repair_key, rid.dt, rid.nss, rid.fss_esi, self._out_view)
        k = self.repairs_sent
        self._rep_window[k, 0], self._rep_window[k, 1] = first, first + count
        self._rep_time[k] = now
        self.repairs_sent = k + 1
        pn = self.sealer.packets_sealed
        self._repairs_at[pn] = self.repairs_sent
        self._sources_at[pn] = self.encoder.next_esi
        self._sent_at[pn] = now
        self.last_data_pn = pn
        for other in self.members:  # it serves every member whose holes its window reaches
            if other.phase.steers and other.phase is not MemberPhase.JOINED:
                other.planner.sent_over(first, first + count)
                other.stale = True
        return self._sent(datagram, "repair")

    def _move_window(self) -> None:
        prefix = -1
        for m in self.members:
            if m.phase.steers and (prefix < 0 or m.prefix < prefix):
                prefix = m.prefix
        if prefix >= 0:
            self.encoder.on_ack(prefix)

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
        pn = self.sealer.packets_sealed  # an ACK may name the DONE as its largest packet
        self._repairs_at[pn], self._sources_at[pn] = self.repairs_sent, self.encoder.next_esi
        self._sent_at[pn] = now
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
        pn = ack.largest_pn
        sample = now - float(self._sent_at[pn]) - ack.ack_delay_us * 1e-6
        if pn > 0 and sample > 0:
            m.rtt = sample if m.rtt <= 0 else m.rtt + RTT_GAIN * (sample - m.rtt)
        planner = m.planner
        seen = int(self._repairs_at[pn])  # the group repairs its ACK accounts for
        planner.on_ack(ack.decoded_prefix, ack.holes, ack.hole_bits, ack.deficit, self.encoder.next_esi,
                       self._rep_window, seen, self.repairs_sent, self._rep_time,
                       now - max(SEEN_RTTS * m.rtt, SEEN_MIN_S),
                       # Sources past its seen end, sent before the packet it names as its largest: lost.
                       ack.seen_end, min(int(self._sources_at[pn]), ack.decoded_prefix + planner.span))
        m.stale = True
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

