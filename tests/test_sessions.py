"""Sender and receiver sessions against each other under fake time (aioquic-style tests).

Loss means not delivering a datagram; time only moves when the harness says so.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from pfec.common.sched.actions import SOURCE_BURST, Action, SchedulerView
from pfec.common.sched.open_loop_tail import BURST_PRIOR, FEEDBACK_RTTS, tail_rate
from pfec.common.sched.policies import DeficitHeuristic, FixedRate, SourceOnly
from pfec.common.wire.frames import peek_header
from pfec.common.wire.messages import (
    Ack,
    Done,
    DoneReason,
    Header,
    Message,
    MsgType,
    Offer,
    RefuseCode,
    Role,
    Source,
)
from pfec.common.wire.seal import PacketProtector
from pfec.receiver import endpoint as endpoint_module
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, OfferReceived, ReceiverConfig, SessionClosed
from pfec.sender.transport import offer as offer_module
from pfec.sender.transport.probe import ProbeTimer
from pfec.sender.transport.session import (
    MAX_SPAN,
    Failed,
    Refused,
    ResultReceived,
    SenderConfig,
    SenderSession,
    SenderState,
    SourceInfo,
    SplitInfo,
)
from pfec.sender.transport.session_types import OFFER_RETRY_S
from pfec.sender.transport.split import SplitBookkeeping
from pfec.sender.transport.transfer import (
    HANDSHAKE_RETRIES_COVERED,
    MAX_FIRST_FLIGHT,
    MIN_FIRST_FLIGHT,
    SPAN_SLACK,
    LinkBudget,
    decoder_span_for,
    first_flight,
)

PSK = b"k" * 32
FP = b"f" * 32
SID = 0x1234_5678_9ABC
SYMBOL = 64
SLOT = 0.0001  # 100 us per datagram
OWD = 0.005


def make_symbols(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, SYMBOL), dtype=np.uint8)


@dataclass
class Harness:
    sender: SenderSession
    endpoint: ReceiverEndpoint
    drop_forward: Callable[[int, bytes], bool] = lambda i, d: False
    drop_reverse: Callable[[int, bytes], bool] = lambda i, d: False
    now: float = 0.0
    in_transit: list[tuple[float, bool, bytes]] = field(default_factory=list)
    forward_index: int = 0
    reverse_index: int = 0
    receiver_events: list[object] = field(default_factory=list)
    sender_events: list[object] = field(default_factory=list)
    result_blob: bytes = b'{"ok": true}'

    def run(self, until: float = 10.0) -> None:
        link_free = 0.0
        ready = True
        while self.now <= until:
            if ready and self.now >= link_free:
                d = self.sender.next_datagram(self.now)
                if d is None:
                    ready = False
                else:
                    link_free = self.now + SLOT
                    if not self.drop_forward(self.forward_index, d):
                        self.in_transit.append((link_free + OWD, True, d))
                    self.forward_index += 1
                    continue
            times = [t for t, _, _ in self.in_transit]
            times += [t for t in (self.sender.get_timer(), self.endpoint.get_timer()) if t is not None]
            if ready:
                times.append(link_free)
            if not times or min(times) > until:
                return  # nothing more happens by ``until``
            self.now = max(self.now, min(times))
            arrived = sorted((x for x in self.in_transit if x[0] <= self.now), key=lambda x: x[0])
            self.in_transit = [x for x in self.in_transit if x[0] > self.now]
            for _t, to_receiver, d in arrived:
                if to_receiver:
                    self.endpoint.receive_datagram(d, self.now)
                else:
                    self.sender.receive_datagram(d, self.now)
                    ready = True
            t = self.sender.get_timer()
            if t is not None and t <= self.now:
                self.sender.handle_timer(self.now)
                ready = True
            t = self.endpoint.get_timer()
            if t is not None and t <= self.now:
                self.endpoint.handle_timer(self.now)
            while (ev := self.endpoint.next_event()) is not None:
                self.receiver_events.append(ev)
                if isinstance(ev, DeadlineReached):
                    self.endpoint.sessions[ev.session_id].send_result(self.result_blob, self.now)
            for _sid, d in self.endpoint.datagrams_to_send():
                if not self.drop_reverse(self.reverse_index, d):
                    self.in_transit.append((self.now + OWD, False, d))
                self.reverse_index += 1
            while (ev := self.sender.next_event()) is not None:
                self.sender_events.append(ev)

    def deadline_event(self) -> DeadlineReached:
        events = [e for e in self.receiver_events if isinstance(e, DeadlineReached)]
        assert len(events) == 1, self.receiver_events
        return events[0]


def make_pair(
    n: int = 200,
    budget_s: float = 0.05,
    policy: object | None = None,
    repair_budget: int = 100,
    fingerprint: bytes = FP,
    receiver_fp: bytes = FP,
    app_blob: bytes = b"",
    window_cap: int = 16,
    config: ReceiverConfig | None = None,
    first_flight: int = 128,
    decoder_span: int = 0,
    loss_prior: float = 0.05,
    fill_idle: bool = False,
) -> tuple[Harness, np.ndarray]:
    symbols = make_symbols(n)
    sender = SenderSession(
        SID,
        SenderConfig(
            budget_s=budget_s,
            slot_s=SLOT,
            owd_s=OWD,
            repair_budget=repair_budget,
            fingerprint=fingerprint,
            window_cap=window_cap,
            app_blob=app_blob,
            result_wait_s=0.5,
            first_flight=first_flight,  # one RTT is 100 slots: the link stays busy through the handshake
            decoder_span=decoder_span,
            loss_prior=loss_prior,
            fill_idle=fill_idle,
        ),
        symbols,
        policy or DeficitHeuristic(),  # type: ignore[arg-type]
        PacketProtector(PSK, SID, Role.SENDER, SYMBOL, random_bytes=random.Random(1).randbytes),
    )
    endpoint = ReceiverEndpoint(PSK, receiver_fp, config or ReceiverConfig(ack_every=2),
                                random_bytes=random.Random(2).randbytes)
    sender.start(0.0)
    return Harness(sender, endpoint), symbols


def test_lossless_handoff_delivers_everything_and_finishes() -> None:
    h, symbols = make_pair(policy=SourceOnly())
    h.run()
    ev = h.deadline_event()
    assert len(ev.decoded_esis) == len(symbols)
    assert np.array_equal(ev.store, symbols)
    assert h.sender.state is SenderState.DONE
    assert any(isinstance(e, ResultReceived) and e.app_blob == h.result_blob for e in h.sender_events)
    assert h.sender.datagrams_sent["repair"] == 0
    assert h.endpoint.sessions == {}  # closed on the sender's CLOSE and reaped


def test_scripted_drops_are_repaired_by_the_heuristic() -> None:
    # Lose the OFFER's neighbours and a burst of data; repairs must fill every hole before the deadline.
    lost = {5, 6, 7, 30, 31, 32, 33, 34, 90, 150}
    # A decoder span of 16 symbols (< the 100-packet RTT) makes the decoder stall until repairs land.
    # Four holes in a row each cost a feedback round trip; the first ACK comes one handshake RTT late (the
    # receiver ACKs once the session is established), so 70 ms rather than 60.
    h, symbols = make_pair(n=200, budget_s=0.07, config=ReceiverConfig(ack_every=2, decoder_span=16))
    h.drop_forward = lambda i, d: i in lost
    h.run()
    ev = h.deadline_event()
    assert len(ev.decoded_esis) == 200
    assert np.array_equal(ev.store, symbols)
    assert h.sender.datagrams_sent["repair"] >= len(lost)
    assert ev.stats.stalls >= 1 and ev.stats.lost == len(lost)


def test_without_repair_the_lost_symbols_stay_missing() -> None:
    lost = {10, 11, 50}
    h, symbols = make_pair(policy=SourceOnly())
    h.drop_forward = lambda i, d: i in lost
    h.run()
    ev = h.deadline_event()
    missing = set(range(200)) - set(ev.decoded_esis.tolist())
    # Datagram 0 is the OFFER, so datagram i carries ESI i - 1.
    assert missing == {i - 1 for i in lost}
    assert np.array_equal(ev.store[ev.decoded_esis], symbols[ev.decoded_esis])


def test_deadline_cuts_the_stream_and_partial_delivery_is_reported() -> None:
    # 200 symbols need 20 ms of link; a 10 ms budget leaves (10 - 5) ms = 50 slots.
    h, _ = make_pair(budget_s=0.010, policy=SourceOnly())
    h.run()
    ev = h.deadline_event()
    assert 40 <= len(ev.decoded_esis) <= 50
    assert np.array_equal(ev.decoded_esis, np.arange(len(ev.decoded_esis)))
    assert h.sender.datagrams_sent["source"] <= 50


def test_the_receiver_starts_when_everything_is_decoded_not_at_the_deadline() -> None:
    """Start when ready: a stream that is whole at ~25 ms under a 50 ms budget ends decoding then, and says
    so; a stream the deadline cuts ends at the deadline and says that."""
    h, symbols = make_pair(policy=SourceOnly(), budget_s=0.05)
    h.run()
    ev = h.deadline_event()
    deadline = ev.stats.deadline_at
    assert ev.ready and len(ev.decoded_esis) == len(symbols), ev
    assert ev.at < deadline - 0.01, (ev.at, deadline)  # 200 slots of 0.1 ms + one-way delays: ~30 ms
    assert h.sender.state is SenderState.DONE

    cut, _ = make_pair(budget_s=0.010, policy=SourceOnly())
    cut.run()
    ev = cut.deadline_event()
    assert not ev.ready and ev.at >= ev.stats.deadline_at and len(ev.decoded_esis) < 200, ev


def test_lost_offer_is_repeated_and_early_data_is_replayed() -> None:
    h, _ = make_pair(policy=SourceOnly(), budget_s=0.08)
    h.drop_forward = lambda i, d: i == 0  # the first OFFER
    h.run()
    ev = h.deadline_event()
    # Data sent before the repeated OFFER waited in the early buffer (bounded) and was decoded.
    assert len(ev.decoded_esis) == 200
    assert h.sender.datagrams_sent["control"] >= 2


def test_receive_path_parses_each_header_once_and_opens_each_datagram_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    peeks: list[int] = []
    opens: list[int] = []
    real_peek, real_open = endpoint_module.peek_header, PacketProtector._open_body

    def counting_peek(data: bytes) -> Header:
        peeks.append(1)
        return real_peek(data)

    def counting_open(self: PacketProtector, sid: int, mtype: int, pn: int, data: bytes, n: int) -> Message:
        opens.append(mtype)
        return real_open(self, sid, mtype, pn, data, n)

    full_opens: list[Role] = []
    real_full_open = PacketProtector.open

    def recording_open(self: PacketProtector, data: bytes) -> tuple[Header, Message]:
        full_opens.append(self.role)
        return real_full_open(self, data)

    monkeypatch.setattr(endpoint_module, "peek_header", counting_peek)
    monkeypatch.setattr(PacketProtector, "_open_body", counting_open)
    monkeypatch.setattr(PacketProtector, "open", recording_open)
    h, _ = make_pair(policy=SourceOnly(), budget_s=0.08)
    h.drop_forward = lambda i, d: i == 0  # the first OFFER: data waits in the early buffer, parsed
    received: list[bytes] = []
    endpoint_receive = h.endpoint.receive_datagram

    def counting_receive(data: bytes, now: float) -> Header | None:
        received.append(data)
        return endpoint_receive(data, now)

    h.endpoint.receive_datagram = counting_receive  # type: ignore[method-assign]
    h.run()
    assert len(h.deadline_event().decoded_esis) == 200
    assert len(peeks) == len(received)  # early data is not parsed again when replayed
    assert Role.RECEIVER not in full_opens  # the receiver's protectors take the parsed header
    # Every datagram the receiver opened was decrypted once (the sender opened only ACKs and control).
    assert opens.count(MsgType.OFFER) == sum(1 for d in received if d[1] == MsgType.OFFER)
    assert opens.count(MsgType.SOURCE) == sum(1 for d in received if d[1] == MsgType.SOURCE)


def test_fingerprint_mismatch_is_refused_with_a_reason() -> None:
    h, _ = make_pair(receiver_fp=b"x" * 32)
    h.run(until=1.0)
    refused = [e for e in h.sender_events if isinstance(e, Refused)]
    assert refused and refused[0].code == RefuseCode.FINGERPRINT_MISMATCH
    assert "fingerprint" in refused[0].reason
    assert h.sender.state is SenderState.FAILED
    assert any(isinstance(e, Failed) and "refused" in e.reason for e in h.sender_events)


def test_offer_app_blob_spans_several_datagrams() -> None:
    blob = bytes(range(256)) * 40  # 10 KiB, several OFFER parts
    h, _ = make_pair(app_blob=blob, policy=SourceOnly())
    h.run()
    offers = [e for e in h.receiver_events if isinstance(e, OfferReceived)]
    assert len(offers) == 1 and offers[0].app_blob == blob


def test_offer_parts_lost_before_the_accept_are_sent_again_after_it() -> None:
    """The receiver answers the OFFER's first part; a later part lost before the ACCEPT came must still
    arrive (it did not: a split's context ids never completed, and the handoff failed at its deadline)."""
    blob = bytes(range(256)) * 40  # 8 OFFER parts
    h, _ = make_pair(app_blob=blob, policy=SourceOnly(), budget_s=0.2)
    parts = len(h.sender.offer.parts)
    assert parts > 2
    h.drop_forward = lambda i, d: i in (1, parts - 2)  # two parts, each sent once before the ACCEPT
    h.run()
    offers = [e for e in h.receiver_events if isinstance(e, OfferReceived)]
    assert len(offers) == 1 and offers[0].app_blob == blob
    # Repeated whole after the ACCEPT (nothing here proves the app arrived), never past the deadline.
    most = parts * (2 + offer_module.REPEATS_AFTER_ACCEPT) + 2
    assert parts * 2 <= h.sender.datagrams_sent["control"] <= most


def test_garbage_forged_and_replayed_datagrams_are_counted_not_fatal() -> None:
    h, _ = make_pair(policy=SourceOnly())
    seen: list[bytes] = []

    def tamper(i: int, d: bytes) -> bool:
        seen.append(d)
        if i == 20:
            h.endpoint.receive_datagram(b"\x00garbage", h.now)  # malformed
            forged = bytearray(d)
            forged[-1] ^= 1
            h.endpoint.receive_datagram(bytes(forged), h.now)  # bit flip in the tag
            other = PacketProtector(b"z" * 32, SID, Role.SENDER, SYMBOL)
            h.endpoint.receive_datagram(other.seal(Source(3, bytes(SYMBOL))), h.now)  # foreign key
        if i == 40:
            h.endpoint.receive_datagram(seen[10], h.now)  # replay
        return False

    h.drop_forward = tamper
    h.run()
    ev = h.deadline_event()
    assert len(ev.decoded_esis) == 200
    drops = h.endpoint.drops
    assert sum(drops.values()) >= 4, drops
    assert drops.get("replay", 0) >= 1 and drops.get("junk_auth", 0) >= 2, drops


def test_vanished_sender_is_reaped_after_its_deadline() -> None:
    h, _ = make_pair(policy=SourceOnly(), config=ReceiverConfig(ack_every=2, result_retries=3))
    h.drop_reverse = lambda i, d: d[1] == MsgType.RESULT  # the sender never sees a RESULT
    h.run(until=5.0)
    assert any(isinstance(e, SessionClosed) and "sender" in e.reason for e in h.receiver_events)
    assert h.endpoint.sessions == {}
    assert h.sender.state is SenderState.FAILED  # it reports the missing RESULT
    assert any(isinstance(e, Failed) and "RESULT" in e.reason for e in h.sender_events)


def test_policy_choosing_a_masked_action_is_an_error() -> None:
    class Bad:
        name = "bad"
        sends_repairs = True

        def decide(self, view: SchedulerView) -> Action:
            return Action.REPAIR_16

        def reset(self) -> None:
            pass

    h, _ = make_pair(policy=Bad())
    with pytest.raises(ValueError, match="masked action"):
        h.run(until=0.01)


def test_fixed_rate_policy_is_open_loop_and_the_others_are_not() -> None:
    policy = FixedRate(rate=0.25)
    assert policy.open_loop and not DeficitHeuristic.open_loop and not SourceOnly.open_loop
    # Open loop: a repair needs no deficit, only credit (2 after 8 sources at 1/4) and a source to protect.
    view = SchedulerView(n_source=100, slots_left=100, repair_budget=10, repairs_left=10, open_loop=True)
    view.sources_sent = 8
    view.window_size = 8
    view.deficit_estimate = 0.0
    assert view.update_mask() and view.mask[Action.REPAIR_1]
    assert policy.decide(view) is Action.REPAIR_1
    assert policy.decide(view) is Action.REPAIR_1
    assert policy.decide(view) is Action.SOURCE  # the credit is spent
    view.sources_sent = 100  # every source is out: nothing left for a fixed-rate code to protect
    assert not view.update_mask()
    # Closed loop (every other scheme): no repair without an estimated deficit.
    closed = SchedulerView(n_source=100, slots_left=100, repair_budget=10, repairs_left=10)
    closed.sources_sent = 8
    closed.window_size = 8
    closed.update_mask()
    assert not closed.mask[Action.REPAIR_1]
    closed.deficit_estimate = 1.0
    closed.update_mask()
    assert closed.mask[Action.REPAIR_1]
    with pytest.raises(ValueError):
        FixedRate(rate=1.5)


def _sources_before(sender: SenderSession, repair: int) -> int:
    """Source symbols the sender had sent when it sent repair number ``repair``."""
    n = sender.encoder.next_esi
    return int(np.count_nonzero(sender.inflight.src_pn[:n] < sender.inflight.rep_pn[repair]))


def test_fixed_rate_repairs_proactively_over_the_newest_window() -> None:
    """No loss at all: the fixed-rate code still sends 1 repair per 8 sources, each over the newest window
    (it ends at the newest source sent); the deficit-driven heuristic sends none."""
    h, symbols = make_pair(policy=FixedRate(rate=0.125))
    h.run()
    assert len(h.deadline_event().decoded_esis) == len(symbols)
    sent = h.sender.view.repairs_sent
    assert 20 <= sent <= len(symbols) // 8
    for i in range(sent):
        first, end = h.sender.inflight.rep_window[i]
        assert end == _sources_before(h.sender, i) and 0 < end - first <= 16  # window_cap 16
    # Closed loop: a handoff long enough for feedback (9.5 RTT; under 6, the first ACK two round trips in
    # leaves no closed-loop cycle, and the heuristic's tail code covers the whole handoff).
    closed, _ = make_pair(policy=DeficitHeuristic(), budget_s=0.1)
    closed.run()
    assert closed.sender.view.repairs_sent == 0


def test_fixed_rate_repairs_aim_at_a_stalled_prefix() -> None:
    """A loss burst the fixed rate cannot cover holds the receiver's prefix; once the newest window lies
    past the decoder span (where the receiver refuses repairs), the repairs cover the window at its prefix,
    and the burst is recovered before the stream ends."""
    lost = {30, 31, 32, 33}  # datagrams: ESIs 26..29 (a repair follows every 8 sources)
    h, symbols = make_pair(n=400, budget_s=0.08, policy=FixedRate(rate=0.125), window_cap=8,
                           config=ReceiverConfig(ack_every=2, decoder_span=16))
    h.drop_forward = lambda i, d: i in lost
    h.run()
    ev = h.deadline_event()
    assert ev.stats.stalls >= 1
    assert len(ev.decoded_esis) == len(symbols)
    assert np.array_equal(ev.store, symbols)
    windows = h.sender.inflight.rep_window[: h.sender.view.repairs_sent]
    assert sum(first == 26 for first, _end in windows) >= 4  # at the stalled prefix: one per hole at least


def test_offer_asks_for_a_decoder_span_and_both_ends_use_the_grant() -> None:
    # The request, above the receiver's default (16 here): granted, and the sender's planner spans it.
    h, symbols = make_pair(decoder_span=150, config=ReceiverConfig(ack_every=2, decoder_span=16))
    h.run(until=0.02)
    (session,) = h.endpoint.sessions.values()
    assert session.span == 150 and session.decoder.window_cap == 150 and h.sender.planner.span == 150
    assert session.config.decoder_span == 150 and h.endpoint.config.decoder_span == 16  # a per-session copy
    # No more than the handoff's source symbols; never below the receiver's own default.
    h, _ = make_pair(decoder_span=1000, config=ReceiverConfig(ack_every=2, decoder_span=16))
    h.run(until=0.02)
    assert h.sender.planner.span == 200 and h.endpoint.sessions[SID].span == 200
    h, _ = make_pair(decoder_span=16, config=ReceiverConfig(ack_every=2, decoder_span=64))
    h.run(until=0.02)
    assert h.sender.planner.span == 64
    # Shrunk to what max_session_bytes leaves for the decoder (the store is 200 x 64 B).
    room = 200 * SYMBOL + endpoint_module.decoder_bytes(100, SYMBOL)
    h, _ = make_pair(decoder_span=200, config=ReceiverConfig(ack_every=2, decoder_span=16,
                                                               max_session_bytes=room))
    h.run(until=0.02)
    assert h.sender.planner.span == 100 and h.endpoint.sessions[SID].span == 100
    h.run()
    assert len(h.deadline_event().decoded_esis) == len(symbols)


def test_a_decoder_span_past_the_codec_is_refused_and_the_store_bound_counts_the_decoder() -> None:
    endpoint = ReceiverEndpoint(PSK, FP, ReceiverConfig(decoder_span=512, max_session_bytes=1 << 20))
    offer = Offer(SYMBOL, 16, 200, 50_000, FP, sender_random=bytes(16), span=4096)
    refusal = endpoint._check_offer(SID, offer)
    assert refusal is not None and refusal[0] is RefuseCode.BAD_PARAMETERS and "4096" in refusal[1]
    assert endpoint._check_offer(SID, replace(offer, span=4095)) is None
    assert endpoint_module.grant_span(replace(offer, span=4095), endpoint.config) == 512  # n_source 200
    # A store that fits alone, but not with the decoder of the receiver's own span: refused, with a reason.
    tight = ReceiverEndpoint(PSK, FP, ReceiverConfig(decoder_span=512, max_session_bytes=200 * SYMBOL + 1000))
    refusal = tight._check_offer(SID, replace(offer, span=0))
    assert refusal is not None and refusal[0] is RefuseCode.OVERLOADED and "span 512" in refusal[1]


def test_the_span_asked_for_covers_two_round_trips_of_packets_and_the_window() -> None:
    def budget(owd_s: float) -> LinkBudget:
        return LinkBudget(rate_bps=1e8, owd_s=owd_s, t_ser_s=1.0, deadline_s=1.0, slot_s=1e-4)

    assert decoder_span_for(budget(0.01), 64, 100_000) == 2 * (200 + SPAN_SLACK) + 64  # 20 ms RTT: 528
    assert decoder_span_for(budget(0.1), 64, 100_000) == MAX_SPAN  # 200 ms RTT: as far as RFC 8681 reaches
    assert decoder_span_for(budget(0.1), 64, 1000) == 1000  # no more than the handoff's symbols
    assert decoder_span_for(budget(0.0), 64, 10) == 64  # never below the window


def test_source_info_features() -> None:
    info = SourceInfo(np.array([3, 3, 3, 0, 0, 1]), np.array([0.5, 0.25, 0.0, 1.0]))
    feats = info.per_esi_features()
    assert feats[:, 0].tolist() == [0, 1 / 3, 2 / 3, 0, 0.5, 0]
    assert feats[:, 1].tolist() == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25]


# --------------------------------------------------------------------------- split handoff (issue 13 item 1)

SPLIT_TOKENS = 160  # 10 blocks of 16 tokens


def make_split_pair(budget_s: float = 0.1, sender_tokens: int = SPLIT_TOKENS,
                    ) -> tuple[Harness, np.ndarray, np.ndarray]:
    """600 symbols, each carrying its stream index in its first 4 bytes and serving one block."""
    h, symbols = make_pair(n=600, policy=SourceOnly(), budget_s=budget_s)
    symbols[:, :4] = np.arange(len(symbols), dtype=">u4").view(np.uint8).reshape(-1, 4)
    ends = (np.random.default_rng(5).integers(0, 10, size=len(symbols)) + 1) * 16
    sender = h.sender
    protector = PacketProtector(PSK, SID, Role.SENDER, SYMBOL, random_bytes=random.Random(1).randbytes)
    h.sender = SenderSession(SID, sender.config, symbols, SourceOnly(), protector,
                             split=SplitInfo(ends.astype(np.int64), sender_tokens))
    h.sender.start(0.0)
    return h, symbols, ends


def _split_session(h: Harness, ends: np.ndarray, until: float, front: int = 0) -> object:
    h.run(until=until)
    session = h.endpoint.sessions[SID]
    session.set_split(ends, SPLIT_TOKENS, front, h.now)
    return session


def test_split_sender_stops_sending_what_the_receiver_computed() -> None:
    """The receiver reports 80 computed tokens mid-stream: the sender never sends the unsent symbols of
    blocks below it, and the receiver starts as soon as everything else is decoded."""
    h, symbols, ends = make_split_pair()
    session = _split_session(h, ends, until=0.016)  # established (one RTT, then the first session datagram)
    sent_before = h.sender.datagrams_sent["source"]
    assert 0 < sent_before < 300
    session.set_computed(80, h.now)  # type: ignore[attr-defined]
    h.run()
    ev = h.deadline_event()
    assert ev.ready and ev.at < ev.stats.deadline_at - 0.01
    got = ev.store[ev.decoded_esis, :4].copy().view(">u4").reshape(-1).astype(np.int64)
    assert len(set(got.tolist())) == len(got)  # each stream index once
    for esi, index in zip(ev.decoded_esis.tolist(), got.tolist(), strict=True):
        assert np.array_equal(ev.store[esi], symbols[index]) or index < 0  # filed by the index inside
    missing = np.setdiff1d(np.arange(len(symbols)), got)
    assert len(missing) > 0 and (ends[missing] <= 80).all()  # only computed blocks never arrived
    assert h.sender.sources_dropped == len(missing)
    assert h.sender.datagrams_sent["source"] == len(symbols) - len(missing)
    assert h.sender.computed_tokens == 80


def test_a_split_sender_is_done_once_the_receiver_lacks_only_what_it_computed() -> None:
    """The stream's last symbols hold only front blocks (a split sends the front backwards after the back);
    ten of them are lost and every repair too. Once the receiver has computed past them and decoded the
    rest, it starts; its ACK tells the sender, which stops with a DONE instead of repairing holes nobody
    needs until the RESULT (which this receiver holds back)."""
    h, symbols, _ = make_split_pair(budget_s=0.2)
    sender = h.sender
    ends = np.concatenate((np.full(400, 96) + 16 * (np.arange(400) % 5), 80 - 16 * (np.arange(200) // 50)))
    sender.split.token_end = ends.astype(np.int64)
    protector = PacketProtector(PSK, SID, Role.SENDER, SYMBOL, random_bytes=random.Random(1).randbytes)
    h.sender = sender = SenderSession(SID, sender.config, symbols, DeficitHeuristic(), protector,
                                      split=SplitInfo(ends.astype(np.int64), SPLIT_TOKENS))
    sender.start(0.0)
    lost = set(range(590, 600))  # token end 32
    sources_seen = [0]

    def drop(_i: int, datagram: bytes) -> bool:
        kind = peek_header(datagram).type
        if kind is MsgType.REPAIR:
            return True
        if kind is MsgType.SOURCE:
            sources_seen[0] += 1
            return sources_seen[0] - 1 in lost
        return False

    h.drop_forward = drop
    session = _split_session(h, ends, until=0.016)
    session.send_result = lambda *_args, **_kw: None  # type: ignore[attr-defined]  # no RESULT: only the ACK
    h.run(until=0.09)
    assert sender.encoder.next_esi == len(symbols) and session.state.value == "receiving"  # type: ignore[attr-defined]
    session.set_computed(80, h.now)  # type: ignore[attr-defined]
    h.receiver_events += list(iter(h.endpoint.next_event, None))
    assert h.deadline_event().ready
    h.in_transit += [(h.now + OWD, False, d) for _sid, d in h.endpoint.datagrams_to_send()]  # its ACK
    h.run(until=h.now + OWD)  # reaches the sender
    repairs = sender.datagrams_sent["repair"]
    assert sender.state is SenderState.DRAINING and sender.completion.reason is DoneReason.DECODED
    h.run(until=0.19)
    assert sender.datagrams_sent["repair"] == repairs  # nothing more after it
    assert sender.completion.sent >= 1  # its DONE


def test_split_bookkeeping_needs_nothing_only_when_every_missing_symbol_is_computed() -> None:
    """``needs_nothing``: undecoded = the hole map's set bits, and every ESI past it; needed = token end
    past the computed tokens."""
    symbols = make_symbols(8)
    ends = np.array([64, 64, 48, 48, 32, 32, 16, 16], dtype=np.int64)
    book = SplitBookkeeping(SplitInfo(ends, 64), symbols)
    ack = Ack(decoded_prefix=2, seen_end=6, decoded_count=4, deficit=2, unknowns=2, largest_pn=9,
              ack_delay_us=0, received=6, lost=2, loss_runs=1, hole_bits=4, holes=bytes([0b1010_0000]),
              computed_tokens=48)
    assert not book.needs_nothing(ack, 8)  # nothing computed yet
    book.on_computed(32, 8)
    assert not book.needs_nothing(ack, 8)  # ESI 2 (token end 48) is a hole
    book.on_computed(48, 8)
    assert book.needs_nothing(ack, 8)  # holes 2 and 4, unseen 6 and 7: all computed
    assert book.needs_nothing(replace(ack, decoded_prefix=0, hole_bits=8, holes=bytes([0b0010_1011])), 8)
    assert not book.needs_nothing(replace(ack, decoded_prefix=0, hole_bits=8, holes=bytes([0b0110_0000])), 8)
    assert not book.needs_nothing(ack, 7)  # ESI 7 not sent yet
    assert not SplitBookkeeping(None, symbols).needs_nothing(ack, 8)  # unsplit: never


def test_split_session_forecasts_where_its_stream_meets_the_fronts_next_chunk() -> None:
    """``front_chunk_end``: a front far slower than the stream ends its chunk at the next step; one far
    faster runs the planned chunk; so does a session that is not (yet) a split."""
    h, _, ends = make_split_pair()
    h.run(until=0.03)
    session = h.endpoint.sessions[SID]
    assert session.front_chunk_end(16, 160, 1.0, h.now) == 160  # no split plan yet: as planned
    session.set_split(ends, SPLIT_TOKENS, 0, h.now)
    assert session.decoder.decoded_count > 0
    assert session.front_chunk_end(16, 160, 1.0, h.now) == 32  # a second a token: the stream wins at once
    assert session.front_chunk_end(16, 160, 1e-9, h.now) == 160  # a nanosecond a token: compute it all
    with pytest.raises(ValueError, match="a chunk"):
        session.front_chunk_end(160, 160, 1.0, h.now)


def test_a_stream_index_is_filed_once_however_often_it_arrives() -> None:
    """The compiled filing kernel: an index carried by two decoded rows counts once, one outside the plan
    not at all; only newly filed indices past the computed tokens come off the missing count."""
    from pfec.receiver.session import _file_stream_indices

    store = np.zeros((4, 8), dtype=np.uint8)
    store[:, :4] = np.array([2, 2, 0, 7], dtype=">u4").view(np.uint8).reshape(-1, 4)  # row 3: index 7
    have = np.zeros(3, dtype=np.bool_)
    ends = np.array([16, 32, 48], dtype=np.int64)
    assert _file_stream_indices(store, np.arange(4, dtype=np.int64), have, ends, 16) == 1  # index 2 (48)
    assert have.tolist() == [True, False, True]
    assert _file_stream_indices(store, np.array([1, 2], dtype=np.int64), have, ends, 0) == 0  # filed before


def test_a_done_does_not_start_a_split_before_its_front_covers_what_is_missing() -> None:
    """A split's sender that gives up (its circuit breaker, a spent cap) says DONE with most of the stream
    unsent: the receiver does not start on what little arrived (it answered garbage from 128 int2 blocks
    in a demo whose receiver py-spy had paused for a second). Its front computes the rest; it starts ready
    once that covers everything missing. After the DONE the front's chunks run as planned."""
    h, _, ends = make_split_pair(budget_s=0.3)
    session = _split_session(h, ends, until=0.016)
    sender = h.sender
    done = Done(sender.encoder.next_esi, sender.view.repairs_sent, sender.protector.packets_sealed - 1,
                DoneReason.NO_REPAIR)
    h.endpoint.receive_datagram(sender.protector.seal(done), h.now)
    assert session.decoder.decoded_count < len(ends)  # type: ignore[attr-defined]
    assert not [e for e in iter(h.endpoint.next_event, None) if isinstance(e, DeadlineReached)]
    assert session.front_chunk_end(16, 160, 1.0, h.now) == 160  # type: ignore[attr-defined]
    session.set_computed(SPLIT_TOKENS, h.now)  # type: ignore[attr-defined]
    started = [e for e in iter(h.endpoint.next_event, None) if isinstance(e, DeadlineReached)]
    assert len(started) == 1 and started[0].start == "ready"


def test_split_receiver_starts_when_it_has_computed_everything() -> None:
    h, _, ends = make_split_pair(budget_s=0.2)
    session = _split_session(h, ends, until=0.016)
    session.set_computed(SPLIT_TOKENS, h.now)  # type: ignore[attr-defined]
    h.run()
    ev = h.deadline_event()
    assert ev.ready and len(ev.decoded_esis) < 300
    with pytest.raises(ValueError, match="outside the context"):
        session.set_computed(SPLIT_TOKENS + 1, h.now)  # type: ignore[attr-defined]


def test_an_ack_reporting_computed_tokens_past_the_context_is_dropped() -> None:
    """The sender's context is 64 tokens; a receiver reporting 80 computed is out of bounds: dropped with
    its reason, and nothing is skipped."""
    h, _, ends = make_split_pair(sender_tokens=SPLIT_TOKENS)
    h.sender.split.n_tokens = 64  # the sender's bound (a receiver that disagrees about the context)
    session = _split_session(h, ends, until=0.016)
    session.set_computed(80, h.now)  # type: ignore[attr-defined]
    h.run(until=0.03)
    assert h.sender.drops.get("bad_ack_computed", 0) >= 1
    assert h.sender.sources_dropped == 0 and h.sender.computed_tokens == 0


def test_split_receiver_waits_for_its_front_even_when_every_symbol_arrived() -> None:
    """The symbols carry only the back; with everything decoded the session still waits until its own
    prefill has covered the front [0, 48), then starts at once."""
    h, symbols, ends = make_split_pair(budget_s=0.2)
    session = _split_session(h, ends, until=0.016, front=48)
    h.run(until=0.09)  # every symbol is decoded by ~75 ms
    assert session.decoder.decoded_count == len(symbols)  # type: ignore[attr-defined]
    assert not [e for e in h.receiver_events if isinstance(e, DeadlineReached)]
    session.set_computed(32, h.now)  # type: ignore[attr-defined]
    assert not [e for e in h.receiver_events if isinstance(e, DeadlineReached)]
    at = h.now  # (the harness stopped at its last event before 90 ms)
    session.set_computed(48, at)  # type: ignore[attr-defined]
    h.run()
    ev = h.deadline_event()
    assert ev.ready and ev.at == at < ev.stats.deadline_at


@pytest.mark.parametrize(("early_datagrams", "early_total", "overflow"),
                         [(2048, 8192, False), (256, 8192, True), (2048, 300, True)])  # fmt: skip
def test_a_first_flight_longer_than_256_is_held_whole_until_the_handshake_completes(
    early_datagrams: int, early_total: int, overflow: bool
) -> None:
    """A long round trip: the ACCEPT comes late, the sender's first flight (one bandwidth-delay product,
    here 600 datagrams) waits in the receiver's early buffer. The default bounds hold it all; a smaller
    per-handshake or total bound drops the excess as ``early_overflow`` (repaired later, never a crash)."""
    config = ReceiverConfig(ack_every=2, early_datagrams=early_datagrams, early_total=early_total)
    h, symbols = make_pair(n=800, budget_s=0.3, policy=SourceOnly(), config=config, first_flight=600)
    h.drop_reverse = lambda i, d: i < 2  # the first ACCEPTs are lost: the handshake takes longer
    h.run()
    ev = h.deadline_event()
    dropped = h.endpoint.drops.get("early_overflow", 0)
    assert (dropped > 0) is overflow, h.endpoint.drops
    if not overflow:
        assert h.sender.datagrams_sent["source"] >= 600
        assert len(ev.decoded_esis) == len(symbols)


def test_a_lost_offer_is_repeated_before_the_receiver_must_drop_early_data() -> None:
    """The OFFER is lost and the ACCEPT takes a round trip: a receiver without an OFFER holds only 256
    datagrams of the session. The OFFER repeats every EARLY_OFFER_EVERY data datagrams until the ACCEPT
    (not only every offer_retry_s, 500 slots here), so nothing of the first flight is dropped."""
    h, symbols = make_pair(n=800, budget_s=0.3, policy=SourceOnly(), first_flight=600)
    h.drop_forward = lambda i, d: i == 0  # the first datagram on the wire is the OFFER
    h.run()
    assert h.endpoint.drops.get("early_overflow", 0) == 0, h.endpoint.drops
    assert len(h.deadline_event().decoded_esis) == len(symbols)


def test_offers_repeated_before_the_accept_do_not_count_as_losses() -> None:
    """A long first flight repeats the OFFER every EARLY_OFFER_EVERY datagrams while the ACCEPT is on its
    way; the receiver counts those copies as received, so a lossless link reports no loss."""
    h, _ = make_pair(n=800, budget_s=0.3, policy=SourceOnly(), first_flight=600)
    h.drop_reverse = lambda i, d: i < 2  # the first ACCEPTs are lost: repeats reach a pending handshake
    h.run()
    lost, seen = h.sender.measured_loss
    assert seen > 600 and lost == 0, (lost, seen)


def test_the_first_flight_covers_the_handshake_and_its_retries() -> None:
    budget = LinkBudget(rate_bps=100e6, owd_s=0.01, t_ser_s=1.0, deadline_s=1.0, slot_s=0.0001)
    assert first_flight(budget) == math.ceil((0.02 + HANDSHAKE_RETRIES_COVERED * OFFER_RETRY_S) / 0.0001) + 16
    assert first_flight(replace(budget, owd_s=0.1)) == MAX_FIRST_FLIGHT  # bounded by what a receiver holds
    assert first_flight(replace(budget, slot_s=0.01)) == MIN_FIRST_FLIGHT


# --------------------------------------------------------------------------- open-loop tail


def test_with_no_feedback_before_the_deadline_the_heuristic_repairs_open_loop() -> None:
    """A deadline under one RTT (send deadline 7 ms, RTT 10 ms): no ACCEPT or ACK can come back in time.
    The closed-loop heuristic still protects its sources open loop at the prior's rate, each repair over
    the newest window; a source-only scheme sends none."""
    prior = 0.1
    h, _ = make_pair(n=200, budget_s=0.012, loss_prior=prior)
    h.run()
    sender = h.sender
    assert sender._send_deadline < 2 * OWD  # nothing the receiver sends arrives while the sender sends
    sources, repairs = sender.datagrams_sent["source"], sender.view.repairs_sent
    rate = tail_rate(prior, BURST_PRIOR, 16)
    # Credit accrues per source and is spent between source bursts: the last burst's may find no slot.
    assert sources * rate - SOURCE_BURST * rate - 1 <= repairs <= sources * rate, (sources, repairs, rate)
    for i in range(repairs):
        first, end = sender.inflight.rep_window[i]
        assert end == _sources_before(sender, i) and 0 < end - first <= 16
    plain, _ = make_pair(n=200, budget_s=0.012, loss_prior=prior, policy=SourceOnly())
    plain.run()
    assert plain.sender.view.repairs_sent == 0
    assert plain.sender.datagrams_sent["source"] == sources + repairs  # the slots the repairs took


def _repairs(sender: SenderSession) -> list[tuple[float, int, int]]:
    sent = sender.inflight
    return [(float(sent.rep_time[i]), int(sent.rep_window[i, 0]), int(sent.rep_window[i, 1]))
            for i in range(sender.view.repairs_sent)]


def test_closed_loop_repair_is_unchanged_until_feedback_can_no_longer_return() -> None:
    """A long deadline with ACKs and scripted losses: every repair before the last 1.5 RTT is the same
    with and without the open-loop tail; only in the tail come extra repairs over the newest window."""
    lost = {40, 41, 120, 300, 301, 302, 420}

    def run(tail: bool) -> Harness:
        h, _ = make_pair(n=900, budget_s=0.1, loss_prior=0.1)  # 9.5 RTT: closed loop until the tail
        h.sender.send_path.tail.enabled = tail
        h.drop_forward = lambda i, d: i in lost
        h.run()
        return h

    with_tail, without = run(True), run(False)
    rtt = with_tail.sender.view.rtt_estimate
    assert 0.01 <= rtt < 0.012
    tail_start = with_tail.sender._send_deadline - FEEDBACK_RTTS * rtt
    before = [r for r in _repairs(with_tail.sender) if r[0] < tail_start]
    assert before and before == [r for r in _repairs(without.sender) if r[0] < tail_start]
    extra = with_tail.sender.view.repairs_sent - without.sender.view.repairs_sent
    assert extra > 0 and with_tail.sender.send_path.tail.active and not without.sender.send_path.tail.active
    lost_count, seen = with_tail.sender.measured_loss  # the ACK counters a daemon keeps per receiver
    assert lost_count == len(lost) and seen > 300


def test_when_no_ack_can_return_in_time_one_open_loop_code_covers_the_whole_handoff() -> None:
    """Send deadline 20 ms, RTT 10 ms: the first ACK can only come back two round trips after the start
    (ACCEPT, then the receiver establishes on the re-sent OFFER part), so no source of this handoff can be
    repaired from feedback, and the open-loop tail starts with the first source, not 1.5 RTT before the
    send deadline. Its repairs reach back to the tail's first source, as wide as the granted span once the
    ACCEPT says it: an early burst of losses that no window of 16 has the repairs for is paid for by the
    repairs after it, and everything decodes."""
    burst = set(range(20, 40))  # forward datagrams (OFFER included): about ESIs 12..30 and their repairs
    h, symbols = make_pair(n=400, budget_s=0.025, loss_prior=0.1, window_cap=16)
    h.drop_forward = lambda i, d: i in burst
    h.run()
    sender = h.sender
    assert sender._send_deadline <= 2 * 2 * OWD + 1e-9  # no ACK arrives while the sender sends
    assert sender.send_path.tail_first == 0
    ev = h.deadline_event()
    sent = sender.encoder.next_esi
    assert len(ev.decoded_esis) == sent and np.array_equal(ev.store[:sent], symbols[:sent])
    windows = [(first, end) for _t, first, end in _repairs(sender)]
    # The newest 16 (the least any receiver grants) before the ACCEPT, then back to the first source.
    assert all(first == 0 or end - first == 16 for first, end in windows)
    wide = [i for i, (first, end) in enumerate(windows) if end - first > 16]
    assert wide and all(first == 0 for first, _end in windows[wide[0]:])


# ---------------------------------------------------------------- never idle while something is missing


def _drop_repairs_and(sources: set[int], first_repairs: int) -> Callable[[int, bytes], bool]:
    """Forward drops: the sources with these ESIs and the first ``first_repairs`` repairs."""
    counts = {MsgType.SOURCE: 0, MsgType.REPAIR: 0}

    def drop(i: int, d: bytes) -> bool:
        kind = peek_header(d).type
        if kind not in counts:
            return False
        counts[kind] += 1  # sources go out in ESI order
        if kind is MsgType.REPAIR:
            return counts[kind] <= first_repairs
        return counts[kind] - 1 in sources

    return drop


def test_a_lost_round_of_repairs_is_probed_not_waited_out() -> None:
    """The stall the default demo and the lossy relay test showed, replayed: three sources lost, the ACK
    reports a deficit of three, the three repairs that answer it are lost, and the receiver (which ACKs
    only what arrives) never ACKs again. The sender counted those repairs as arriving, so it saw no
    deficit left and idled until the deadline with three symbols missing. The probe timer fires, the
    probes fill the holes, and the receiver starts long before its deadline."""
    h, symbols = make_pair(n=200, budget_s=0.3)
    h.drop_forward = _drop_repairs_and({59, 60, 119}, first_repairs=3)
    h.run()
    ev = h.deadline_event()
    assert ev.ready and np.array_equal(ev.store, symbols), ev
    assert ev.at < 0.1 < ev.stats.deadline_at, ev.at
    assert h.sender.probe.sent >= 1


def test_a_lost_ack_is_probed_too() -> None:
    """The ACKs that report the last holes are lost (every ACK until 100 ms) and the receiver receives
    nothing more to ACK: the probes elicit new ones once the path heals."""
    h, symbols = make_pair(n=200, budget_s=0.3)
    h.drop_forward = _drop_repairs_and({150, 198, 199}, first_repairs=0)
    h.drop_reverse = lambda i, d: i >= 5 and h.now < 0.1
    h.run()
    ev = h.deadline_event()
    assert ev.ready and np.array_equal(ev.store, symbols), ev
    assert ev.at < 0.2, ev.at
    assert h.sender.probe.sent >= 1


def test_a_probe_with_nothing_left_to_repair_gives_its_slot_back_to_the_sources() -> None:
    """Seen in CI (three handoffs at once on a loaded 2-core machine): the probe timer expired while the
    receiver's ACK was late, the ACK then acknowledged every source sent, and both probes found nothing to
    repair. The sender returned no datagram, armed no timer and idled to its deadline with most of its
    sources unsent (one handoff sent 272 of 1024). A probe that finds nothing to repair is dropped and the
    slot goes to the policy: the next source."""
    h, symbols = make_pair(n=2000, budget_s=0.5)
    h.run(until=0.03)
    sender = h.sender
    assert sender.accepted and 0 < sender.encoder.next_esi < 2000, sender.encoder.next_esi
    while sender._burst_left:  # the source burst under way goes out first
        h.in_transit.append((h.now + 1.0, True, sender.next_datagram(h.now)))  # after those in transit
    sender.probe.expire()  # the timer fires first, then everything in transit arrives and is ACKed
    for _t, to_receiver, d in sorted(h.in_transit, key=lambda x: x[0]):
        if to_receiver:
            h.endpoint.receive_datagram(d, h.now)
    h.endpoint.handle_timer(h.now + 0.01)
    for _sid, d in h.endpoint.datagrams_to_send():
        sender.receive_datagram(d, h.now)
    h.in_transit = []
    assert sender.inflight.acked_source_end == sender.encoder.next_esi  # nothing unacknowledged
    datagram = sender.next_datagram(h.now)
    assert datagram is not None and peek_header(datagram).type is MsgType.SOURCE
    assert sender.probe.sent == 0  # no probe was sent: none is counted
    h.run()
    ev = h.deadline_event()
    assert ev.ready and np.array_equal(ev.store, symbols), ev


def test_lost_last_sources_are_repaired_though_the_receiver_never_saw_them() -> None:
    """The last sources lost: the receiver's seen end stops before them, its map shows no hole and its
    deficit is 0, yet it ACKs the repairs sent after them. The sender counts sources past the seen end,
    sent before the packet the ACK names, as lost (measured: 10% of tiny relay handoffs ended so)."""
    h, symbols = make_pair(n=200, budget_s=0.3)
    h.drop_forward = _drop_repairs_and({60, 120, 198, 199}, first_repairs=0)
    h.run()
    ev = h.deadline_event()
    assert ev.ready and np.array_equal(ev.store, symbols), ev
    assert ev.at < 0.1, ev.at


def test_open_loop_and_source_only_schemes_never_probe() -> None:
    """The baselines keep their rules: a fixed-rate code and a source-only stream send no probe."""
    for policy in (FixedRate(0.1), SourceOnly()):
        h, _ = make_pair(n=200, budget_s=0.3, policy=policy)
        h.drop_forward = _drop_repairs_and({60, 61, 120, 198, 199}, first_repairs=3)
        h.run()
        assert h.sender.probe.sent == 0, policy


def test_probe_timeout_follows_the_rtt_and_backs_off() -> None:
    """PTO = srtt + max(4 rttvar, 1 ms) + max ACK delay; before a sample 3 x the prior plus the ACK delay;
    doubled per expiry, reset by an ACK."""
    timer = ProbeTimer(max_ack_delay_s=0.005, rtt_prior_s=0.02)
    assert timer.timeout(0.0, 0.0) == pytest.approx(0.02 + 4 * 0.01 + 0.005)
    assert timer.timeout(0.010, 0.0001) == pytest.approx(0.010 + 0.001 + 0.005)
    timer.on_sent(1.0, False)
    assert timer.deadline(0.010, 0.002) == pytest.approx(1.0 + 0.010 + 0.008 + 0.005)
    timer.expire()
    assert timer.take() and timer.take() and not timer.take()  # two probes per expiry
    timer.on_sent(1.001, True)
    timer.on_sent(1.002, True)
    assert timer.sent == 2  # counted when sent, not when taken
    assert timer.timeout(0.010, 0.002) == pytest.approx(2 * 0.023)
    timer.expire()
    assert timer.timeout(0.010, 0.002) == pytest.approx(4 * 0.023)
    timer.on_ack()
    assert timer.timeout(0.010, 0.002) == pytest.approx(0.023)


def test_with_the_whole_deadline_as_budget_idle_slots_carry_repairs() -> None:
    """The same lost round of repairs: a sender whose budget is the whole deadline does not wait a probe
    timeout, it fills the slots that would idle with repairs where the receiver lacks most, and the
    receiver starts sooner. A fixed budget (the paper's rule) leaves those slots idle."""
    drops = {59, 60, 119}
    probed, symbols = make_pair(n=200, budget_s=0.3)
    probed.drop_forward = _drop_repairs_and(drops, first_repairs=3)
    probed.run()
    filled, _ = make_pair(n=200, budget_s=0.3, fill_idle=True)
    filled.drop_forward = _drop_repairs_and(drops, first_repairs=3)
    filled.run()
    at_probed, at_filled = probed.deadline_event(), filled.deadline_event()
    assert at_filled.ready and np.array_equal(at_filled.store, symbols)
    assert filled.sender.send_path.repairs_filled > 0 == probed.sender.send_path.repairs_filled
    assert at_filled.at < at_probed.at, (at_filled.at, at_probed.at)
    for policy in (SourceOnly(), FixedRate(0.1)):  # no repairs, or open loop: nothing to fill
        h, _ = make_pair(n=200, budget_s=0.3, policy=policy, fill_idle=True)
        h.drop_forward = _drop_repairs_and(drops, first_repairs=3)
        h.run()
        assert h.sender.send_path.repairs_filled == 0, policy


# ------------------------------------------------------------------------------- the completion signal


def test_a_source_only_stream_says_done_and_the_receiver_starts_at_once() -> None:
    """A scheme without repairs has nothing more to send once its last source is out: its DONE starts
    the receiver then (``sender-done``), holes and all, instead of at its deadline."""
    h, _ = make_pair(n=200, budget_s=0.3, policy=SourceOnly())
    h.drop_forward = _drop_repairs_and({10, 11, 150}, first_repairs=0)
    h.run()
    ev = h.deadline_event()
    assert ev.start == "sender-done" and not ev.ready, ev
    assert ev.at < 0.05 < ev.stats.deadline_at and ev.started_at == ev.at
    assert len(ev.decoded_esis) == 197
    assert h.sender.completion.reason is DoneReason.NO_REPAIR and h.sender.state is SenderState.DONE


def test_a_spent_repair_cap_says_done_and_a_lost_done_is_repeated() -> None:
    """A cap of two repairs against five losses: once both are out the sender can do nothing more, says
    so, and the first DONE lost, its repeat a round trip later starts the receiver."""
    h, _ = make_pair(n=200, budget_s=0.3, repair_budget=2)
    dones = [0]
    lossy = _drop_repairs_and({20, 21, 22, 100, 180}, first_repairs=0)

    def drop(i: int, d: bytes) -> bool:
        if peek_header(d).type is MsgType.DONE:
            dones[0] += 1
            return dones[0] == 1
        return lossy(i, d)

    h.drop_forward = drop
    h.run()
    ev = h.deadline_event()
    assert h.sender.completion.reason is DoneReason.BUDGET_SPENT and h.sender.view.repairs_sent == 2
    assert dones[0] >= 2  # the first was lost, a repeat arrived
    assert ev.start == "sender-done" and ev.at < 0.1 < ev.stats.deadline_at, ev
    assert len(ev.decoded_esis) < 200


def _established(budget_s: float = 0.3) -> tuple[Harness, SenderSession]:
    h, _ = make_pair(n=200, budget_s=budget_s, policy=SourceOnly())
    h.run(until=0.016)  # the handshake is done (one RTT, then a session datagram), sources still stream
    assert h.sender.accepted and SID in h.endpoint.sessions
    return h, h.sender


@pytest.mark.parametrize(
    ("done", "why"),
    [
        (lambda s: Done(201, 0, 1, DoneReason.NO_REPAIR), "more sources than the handoff has"),
        (lambda s: Done(3, 0, 1, DoneReason.NO_REPAIR), "fewer sources than an ESI the receiver saw"),
        (lambda s: Done(s.encoder.next_esi, 0, s.protector.packets_sealed + 5, DoneReason.NO_REPAIR),
         "a last data packet after its own"),
    ],
)
def test_a_done_that_contradicts_what_arrived_is_dropped_and_counted(
    done: Callable[[SenderSession], Done], why: str
) -> None:
    h, sender = _established()
    h.endpoint.receive_datagram(sender.protector.seal(done(sender)), h.now)
    h.receiver_events.extend(iter(h.endpoint.next_event, None))  # session drops reach the endpoint's count
    assert h.endpoint.drops.get("bad_done") == 1, why
    assert not [e for e in h.receiver_events if isinstance(e, DeadlineReached)]
    forged_at = h.now
    h.run()
    assert h.deadline_event().at > forged_at  # it started later, on what really arrived


def test_a_replayed_or_foreign_or_early_done_is_dropped_and_never_starts_the_receiver() -> None:
    h, sender = _established()
    datagram = sender.protector.seal(Done(sender.encoder.next_esi, 0, sender.protector.packets_sealed - 1,
                                          DoneReason.NO_REPAIR))
    h.endpoint.receive_datagram(datagram, h.now)  # genuine: the receiver starts on it
    h.endpoint.receive_datagram(datagram, h.now)  # the same datagram again: a replay
    assert h.endpoint.drops.get("replay") == 1
    started = [e for e in iter(h.endpoint.next_event, None) if isinstance(e, DeadlineReached)]
    assert len(started) == 1 and started[0].start == "sender-done"
    # Another session's DONE (unknown to this receiver), and one sealed before the session keys.
    other = PacketProtector(PSK, SID + 1, Role.SENDER, SYMBOL, random_bytes=random.Random(9).randbytes)
    other.set_peer_random(bytes(16))
    before = dict(h.endpoint.drops)
    h.endpoint.receive_datagram(other.seal(Done(1, 0, 0, DoneReason.NO_REPAIR)), h.now)
    assert sum(h.endpoint.drops.values()) == sum(before.values()) + 1
    # Before the ACCEPT the sender has no session keys and cannot seal one: a DONE is never early.
    fresh, _ = make_pair(n=200, budget_s=0.3)
    with pytest.raises(ValueError, match="never sends DONE in phase EARLY"):
        fresh.sender.protector.seal(Done(0, 0, 0, DoneReason.NO_REPAIR))


def test_the_accept_states_the_receivers_prefill_speed_and_an_implausible_one_is_defaulted() -> None:
    from pfec.sender.transport.session import Accepted

    h, _ = make_pair(n=64, budget_s=0.2)
    h.endpoint.prefill_statement = (219300, 733700, 652500, 81000)
    h.run()
    accepted = [e for e in h.sender_events if isinstance(e, Accepted)]
    assert accepted and accepted[0].receiver is not None
    assert accepted[0].receiver.prefill.b == pytest.approx(7.337e-4)
    absurd, _ = make_pair(n=64, budget_s=0.2)
    absurd.endpoint.prefill_statement = (1000, 0, 0, 1000)  # no per-token cost
    absurd.run()
    accepted = [e for e in absurd.sender_events if isinstance(e, Accepted)]
    # planned on the stored curve, which the model names as defaulted
    assert accepted and accepted[0].receiver is not None and "prefill" in accepted[0].receiver.defaulted
    assert absurd.sender.state is SenderState.DONE  # the ACCEPT applies
