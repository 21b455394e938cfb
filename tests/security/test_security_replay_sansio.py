"""Issue 12, sans-IO: a replay opens nothing, the receiver does not amplify, and a forged datagram costs no
key derivation.

A real handoff (SenderSession <-> ReceiverEndpoint, fake time) is captured; the receiver restarts (a new
endpoint object); every captured datagram is replayed, in order, reversed, twice, and after the pending
handshake expired. No ReceiverSession may appear, no OfferReceived or DeadlineReached, and the restarted
receiver may send at most 3x the bytes it received.
"""

from __future__ import annotations

import random
import struct
import timeit

import numpy as np
import pytest

from pfec.common.sched.policies import DeficitHeuristic, SourceOnly
from pfec.common.wire.frames import peek_header
from pfec.common.wire.messages import KeyPhase, MsgType, Offer, RefuseCode, Role
from pfec.common.wire.seal import Keyring, PacketProtector
from pfec.receiver import endpoint as endpoint_module
from pfec.receiver.endpoint import AMPLIFICATION_FACTOR, ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, OfferReceived, ReceiverConfig
from pfec.sender.transport.session import SenderConfig, SenderSession, SenderState

PSK = bytes(range(32))
FP = b"r" * 32
SYMBOL = 32
SID = 0xABCD


def endpoint(seed: int) -> ReceiverEndpoint:
    return ReceiverEndpoint(Keyring(PSK), FP, ReceiverConfig(ack_every=2, handshake_timeout_s=0.5),
                            random_bytes=random.Random(seed).randbytes)


def capture_handoff() -> list[bytes]:
    """Every datagram of one complete handoff (both directions), with a multi-part OFFER and repairs."""
    symbols = np.random.default_rng(3).integers(0, 256, size=(300, SYMBOL), dtype=np.uint8)
    sender = SenderSession(
        SID,
        SenderConfig(budget_s=0.2, slot_s=0.0001, owd_s=0.002, repair_budget=60, fingerprint=FP,
                     app_blob=bytes(3000), first_flight=64, result_wait_s=0.5),
        symbols, DeficitHeuristic(),
        PacketProtector(Keyring(PSK), SID, Role.SENDER, SYMBOL, random_bytes=random.Random(1).randbytes),
    )
    rx = endpoint(2)
    captured: list[bytes] = []
    back: list[tuple[float, bytes]] = []  # receiver -> sender, 4 ms on the way (the first flight goes early)
    now = 0.0
    sender.start(now)
    sent = 0
    for _ in range(50000):
        d = sender.next_datagram(now)
        if d is not None:
            captured.append(d)
            sent += 1
            if sent % 37 != 5:  # a few losses: repairs and ACKs with holes
                rx.receive_datagram(d, now)
        while (ev := rx.next_event()) is not None:
            if isinstance(ev, DeadlineReached):
                rx.sessions[ev.session_id].send_result(b'{"ok": 1}', now)
        for _sid, r in rx.datagrams_to_send():
            captured.append(r)
            back.append((now + 0.004, r))
        while back and back[0][0] <= now:
            sender.receive_datagram(back.pop(0)[1], now)
        if sender.state is SenderState.DONE:
            break
        now += 0.0001
        for side in (sender, rx):
            if (t := side.get_timer()) is not None and t <= now:
                side.handle_timer(now)
    assert sender.state is SenderState.DONE
    types = {(peek_header(d).phase, peek_header(d).type) for d in captured}
    assert (KeyPhase.HANDSHAKE, MsgType.OFFER) in types and (KeyPhase.EARLY, MsgType.SOURCE) in types
    assert (KeyPhase.SESSION, MsgType.REPAIR) in types and (KeyPhase.HANDSHAKE, MsgType.ACCEPT) in types
    return captured


@pytest.fixture(scope="module")
def captured() -> list[bytes]:
    return capture_handoff()


def replay_into(rx: ReceiverEndpoint, datagrams: list[bytes], now: float) -> tuple[int, int, list[object]]:
    """(bytes received, bytes sent, events) of a replay."""
    received = sent = 0
    events: list[object] = []
    for d in datagrams:
        rx.receive_datagram(d, now)
        received += len(d)
        while (ev := rx.next_event()) is not None:
            events.append(ev)
        sent += sum(len(out) for _sid, out in rx.datagrams_to_send())
        now += 0.0001
    return received, sent, events


@pytest.mark.parametrize("order", ["in_order", "reversed", "twice", "after_expiry"])
def test_a_replay_after_restart_opens_nothing_and_does_not_amplify(captured: list[bytes], order: str) -> None:
    rx = endpoint(99)  # the restarted receiver: new process, new randomness
    datagrams = {"in_order": captured, "reversed": captured[::-1], "twice": captured + captured,
                 "after_expiry": captured}[order]
    received, sent, events = replay_into(rx, datagrams, 10.0)
    if order == "after_expiry":
        rx.handle_timer(20.0)
        assert rx.drops.get("handshake_expired", 0) == 1 and not rx.pending_handshakes()
        more = replay_into(rx, captured, 30.0)  # the expired id is remembered: not even an ACCEPT
        assert more[1] == 0
    assert not rx.sessions, "a replay established a session"
    assert not [e for e in events if isinstance(e, (OfferReceived, DeadlineReached))], events
    assert sent <= AMPLIFICATION_FACTOR * received
    assert sent <= 116 * 4, sent  # in fact a few ACCEPTs (116 B) at most: the replayed OFFER parts' answers
    # The replayed session datagrams open under no key the restarted receiver holds (its R_r is new), or
    # meet no session at all (before the replayed OFFER, or once its handshake expired).
    assert rx.drops.get("junk_auth", 0) + rx.drops.get("no_session", 0) > 100, rx.drops
    if order == "in_order":
        assert rx.drops.get("junk_auth", 0) > 100, rx.drops


def test_repeated_offers_get_the_same_accept_bytes_within_the_budget(captured: list[bytes]) -> None:
    offer = next(d for d in captured if d[1] == 0x84)
    rx = endpoint(5)
    replies: list[bytes] = []
    for _ in range(50):
        rx.receive_datagram(offer, 1.0)
        replies += [d for _sid, d in rx.datagrams_to_send()]
    assert len(set(replies)) == 1  # the same sealed ACCEPT: identical ciphertext, no second nonce
    assert len(replies) * len(replies[0]) <= AMPLIFICATION_FACTOR * 50 * len(offer)
    [info] = rx.pending_handshakes()
    assert info.session_id == SID and info.bytes_sent <= AMPLIFICATION_FACTOR * info.bytes_received
    assert not rx.sessions


def small_offer() -> tuple[Keyring, bytes]:
    kr = Keyring(PSK)
    s = PacketProtector(kr, SID, Role.SENDER, SYMBOL, random_bytes=random.Random(8).randbytes)
    return kr, s.seal(Offer(SYMBOL, 16, 10, 100_000, FP, 0, 1, b"", s.local_random))


def test_the_budget_stops_replies_before_establishment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 3x check itself (an ACCEPT, 116 B, is below 3x any OFFER, >= 108 B, so with the real factor it
    never binds: here the factor is cut to show that the budget, not the sizes, is what is enforced)."""
    kr, offer = small_offer()
    monkeypatch.setattr(endpoint_module, "AMPLIFICATION_FACTOR", 0.75)
    rx = ReceiverEndpoint(kr, FP, ReceiverConfig(), random_bytes=random.Random(9).randbytes)
    sent = []
    for copies in range(1, 4):
        rx.receive_datagram(offer, 0.0)
        sent += [len(d) for _sid, d in rx.datagrams_to_send()]
        assert sum(sent) <= 0.75 * copies * len(offer)
    assert rx.drops["amplification_limit"] == 1 and len(sent) == 2  # the first copy earned too little


def test_a_refusal_is_clipped_to_three_times_the_offer() -> None:
    kr, offer = small_offer()
    rx = ReceiverEndpoint(kr, FP, ReceiverConfig(), admit=lambda sid, o: (RefuseCode.OTHER, "why " * 128),
                          random_bytes=random.Random(9).randbytes)
    rx.receive_datagram(offer, 0.0)
    [(_sid, refuse)] = rx.datagrams_to_send()
    assert peek_header(refuse).type is MsgType.REFUSE
    assert len(refuse) <= AMPLIFICATION_FACTOR * len(offer) < 30 + 12 + 1 + 512


def test_forged_offers_cost_no_key_derivation_and_create_nothing() -> None:
    kr = Keyring(PSK)
    rx = ReceiverEndpoint(kr, FP, ReceiverConfig(), random_bytes=random.Random(4).randbytes)
    forger = PacketProtector(Keyring(bytes(32)), SID, Role.SENDER, SYMBOL)  # no key: another PSK
    forged = forger.seal(Offer(SYMBOL, 16, 10, 100_000, FP, 0, 1, b"x" * 200, forger.local_random))
    derivations = kr.derivations
    for i in range(200):
        d = bytearray(forged)
        d[2:10] = struct.pack(">Q", i)  # every forgery names a new session id
        rx.receive_datagram(bytes(d), 0.0)
    assert kr.derivations == derivations  # not one HKDF
    assert rx.drops == {"junk_auth": 200}
    assert not rx.pending_handshakes() and not rx.sessions and not rx.datagrams_to_send()
    per = min(timeit.repeat(lambda: rx.receive_datagram(forged, 0.0), number=2000, repeat=3)) / 2000
    assert per < 200e-6, f"{per * 1e6:.1f} us per forged OFFER"  # a few us in practice; loose for CI


def flipped(datagram: bytes) -> bytes:
    """The datagram with one tag bit flipped: a forgery that names the same session id and packet number."""
    return datagram[:-1] + bytes([datagram[-1] ^ 1])


def test_a_forged_datagram_for_a_pending_handshake_derives_its_keys_once(captured: list[bytes]) -> None:
    """A pending handshake needs an authentic (perhaps replayed) OFFER; then the first forged early or
    session datagram naming its id costs the handshake's three key derivations (K0_s2r, K_s2r, K_r2s),
    once: later forgeries cost an AES-GCM open each, and none opens anything (docs/SECURITY.md)."""
    kr = Keyring(PSK)
    rx = ReceiverEndpoint(kr, FP, ReceiverConfig(), random_bytes=random.Random(6).randbytes)
    offer = next(d for d in captured if d[1] == 0x84)
    rx.receive_datagram(offer, 0.0)
    assert len(rx.pending_handshakes()) == 1
    early = next(d for d in captured if peek_header(d).phase is KeyPhase.EARLY)
    data = next(d for d in captured if peek_header(d).phase is KeyPhase.SESSION
                and peek_header(d).type in (MsgType.SOURCE, MsgType.REPAIR))
    before = kr.derivations
    rx.receive_datagram(flipped(early), 0.0)
    assert kr.derivations - before == 3
    for d in (flipped(data), flipped(early)) * 50:
        rx.receive_datagram(d, 0.0)
    assert kr.derivations - before == 3  # derived once per pending handshake, not per datagram
    assert rx.drops == {"junk_auth": 101}, rx.drops
    assert not rx.sessions and rx.early_held == 0


def first_flight_of(sid: int, n: int) -> tuple[SenderSession, list[bytes]]:
    """A sender and what it sends before any ACCEPT: its OFFER and a first flight of ``n`` early datagrams."""
    symbols = np.random.default_rng(sid).integers(0, 256, size=(40, SYMBOL), dtype=np.uint8)
    sender = SenderSession(
        sid,
        SenderConfig(budget_s=0.2, slot_s=0.0001, owd_s=0.002, repair_budget=0, fingerprint=FP,
                     first_flight=n, result_wait_s=0.5),
        symbols, SourceOnly(),
        PacketProtector(Keyring(PSK), sid, Role.SENDER, SYMBOL, random_bytes=random.Random(sid).randbytes),
    )
    sender.start(0.0)
    flight: list[bytes] = []
    while (d := sender.next_datagram(0.0)) is not None:
        flight.append(d)
    assert len(flight) == 1 + n
    return sender, flight


def test_replayed_first_flights_fill_the_early_total_for_one_handshake_timeout() -> None:
    """What docs/SECURITY.md leaves unprotected, with its bounds: replayed OFFERs and first flights hold
    early data up to ``early_total`` until their handshakes expire; a legitimate first flight arriving
    meanwhile is dropped (``early_overflow``) and counts as lost, but its handshake still establishes and
    the handoff completes. At expiry the replayed data is freed and the ids are remembered as ended."""
    flight = 8
    cfg = ReceiverConfig(ack_every=2, early_datagrams=flight, early_total=3 * flight, handshake_timeout_s=0.5)
    rx = ReceiverEndpoint(Keyring(PSK), FP, cfg, random_bytes=random.Random(7).randbytes)
    for sid in (1, 2, 3):  # captured handshakes the restarted receiver has never seen
        for d in first_flight_of(sid, flight)[1]:
            rx.receive_datagram(d, 0.0)
    rx.datagrams_to_send()  # ACCEPTs no replayer can use
    assert rx.early_held == cfg.early_total and not rx.drops

    sender, datagrams = first_flight_of(7, flight)
    now = 0.0
    for d in datagrams:
        rx.receive_datagram(d, now)
    assert rx.drops == {"early_overflow": flight}, rx.drops
    for _ in range(10000):
        while (ev := rx.next_event()) is not None:
            if isinstance(ev, DeadlineReached):
                rx.sessions[ev.session_id].send_result(b"{}", now)
        for _sid, reply in rx.datagrams_to_send():
            sender.receive_datagram(reply, now)
        while sender.next_event() is not None:
            pass
        if (d := sender.next_datagram(now)) is not None:
            rx.receive_datagram(d, now)
            continue
        if sender.state in (SenderState.DONE, SenderState.FAILED):
            break
        now = min(t for t in (sender.get_timer(), rx.get_timer()) if t is not None)
        for side in (sender, rx):
            if (t := side.get_timer()) is not None and t <= now:
                side.handle_timer(now)
    assert sender.state is SenderState.DONE and sender.accepted
    assert sender.measured_loss == (flight, 40)  # the first flight, as if lost on the path
    rx.handle_timer(1.0)
    assert rx.drops["handshake_expired"] == 3 and rx.early_held == 0 and not rx.pending_handshakes()
    for sid in (1, 2, 3):  # a second replay of the same captures holds nothing
        for d in first_flight_of(sid, flight)[1]:
            rx.receive_datagram(d, 1.0)
    assert rx.early_held == 0 and not rx.pending_handshakes()
