"""Issue 12: no (key, nonce) pair is ever sealed twice, by either side, across receiver restarts, replays
of captured datagrams, session-id reuse and evictions (sans-IO, real sessions and endpoint).

Every AES-GCM object the seal module builds is wrapped (monkeypatched ``AESGCM``) to record its key and
each nonce it seals with, and each derived key is labelled with its HKDF info (so its direction is known);
a hypothesis-chosen story of handoffs, restarts and replays runs, and no pair may repeat, within the story
or across all stories. Each story checks that it sealed under both directions' session keys itself.
Randomness is seeded (reproducible) but, as with os.urandom, never repeats between two endpoints or
senders.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfec.common.sched.policies import SourceOnly
from pfec.common.wire import keyring as keyring_module
from pfec.common.wire.messages import Role
from pfec.common.wire.seal import Keyring, PacketProtector
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, ReceiverConfig
from pfec.sender.transport.session import SenderConfig, SenderSession, SenderState

PSK = bytes(range(32))
FP = b"n" * 32
SYMBOL = 16
SIDS = (0x11, 0x22, 0x33)  # few, so that stories reuse session ids

SEALS: list[tuple[bytes, bytes]] = []  # every (key, nonce) sealed in this test, all examples together
KEY_INFO: dict[bytes, bytes] = {}  # derived key -> its HKDF info (names the direction and key kind)


class RecordingAESGCM:
    """AESGCM wrapper that records (key, nonce) for every seal."""

    def __init__(self, key: bytes) -> None:
        self._inner = AESGCM(key)
        self.recorded_key = bytes(key)

    def encrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes:
        SEALS.append((self.recorded_key, bytes(nonce)))
        return self._inner.encrypt(nonce, data, associated_data)

    def decrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes:
        return self._inner.decrypt(nonce, data, associated_data)


def labelling_hkdf(psk: bytes, salt: bytes, info: bytes) -> bytes:
    key = REAL_HKDF(psk, salt, info)
    KEY_INFO[key] = info
    return key


REAL_HKDF = keyring_module._hkdf


@pytest.fixture(autouse=True)
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Once per test function (hypothesis runs every example inside it): SEALS spans all examples."""
    monkeypatch.setattr(keyring_module, "AESGCM", RecordingAESGCM)
    monkeypatch.setattr(keyring_module, "_hkdf", labelling_hkdf)
    SEALS.clear()
    KEY_INFO.clear()
    yield
    SEALS.clear()
    KEY_INFO.clear()


_seeds = itertools.count(1)


def fresh_random() -> random.Random:
    """A new, never-reused stream (what os.urandom is to a real process)."""
    return random.Random(next(_seeds) * 7919)


def new_endpoint() -> ReceiverEndpoint:
    config = ReceiverConfig(ack_every=2, max_handshakes=2, closed_memory=2, handshake_timeout_s=0.2)
    return ReceiverEndpoint(Keyring(PSK), FP, config, random_bytes=fresh_random().randbytes)


def new_sender(sid: int, n: int) -> SenderSession:
    symbols = np.random.default_rng(sid).integers(0, 256, size=(n, SYMBOL), dtype=np.uint8)
    cfg = SenderConfig(budget_s=0.05, slot_s=0.0001, owd_s=0.001, repair_budget=0, fingerprint=FP,
                       first_flight=4, result_wait_s=0.2, handshake_timeout_s=0.1)
    protector = PacketProtector(Keyring(PSK), sid, Role.SENDER, SYMBOL,
                                random_bytes=fresh_random().randbytes)
    return SenderSession(sid, cfg, symbols, SourceOnly(), protector)


def run_handoff(sender: SenderSession, endpoint: ReceiverEndpoint, now: float,
                captured: list[bytes]) -> float:
    """A lossless zero-delay handoff to its end (or failure); every sender datagram is captured."""
    sender.start(now)
    for _ in range(5000):
        while (d := sender.next_datagram(now)) is not None:
            captured.append(d)
            endpoint.receive_datagram(d, now)
        while (ev := endpoint.next_event()) is not None:
            if isinstance(ev, DeadlineReached):
                endpoint.sessions[ev.session_id].send_result(b"{}", now)
        for _sid, d in endpoint.datagrams_to_send():
            sender.receive_datagram(d, now)
        while sender.next_event() is not None:
            pass
        if sender.state in (SenderState.DONE, SenderState.FAILED) and not endpoint.sessions:
            break
        timers = [t for t in (sender.get_timer(), endpoint.get_timer()) if t is not None]
        if not timers:
            break
        now = max(now, min(timers))
        if (t := sender.get_timer()) is not None and t <= now:
            sender.handle_timer(now)
        if (t := endpoint.get_timer()) is not None and t <= now:
            endpoint.handle_timer(now)
    return now


def replay(endpoint: ReceiverEndpoint, datagrams: list[bytes], now: float) -> float:
    for d in datagrams:
        endpoint.receive_datagram(d, now)
    while endpoint.next_event() is not None:
        pass
    endpoint.datagrams_to_send()
    now += 0.5  # let pending handshakes expire (and evictions happen)
    endpoint.handle_timer(now)
    return now


def session_key_seals(seals: list[tuple[bytes, bytes]], direction: bytes) -> int:
    """How many of ``seals`` used a session key (not a handshake or early key) of ``direction``."""
    prefix = b"pfec/2 " + direction
    return sum(1 for key, _ in seals
               if KEY_INFO[key].startswith(prefix) and not KEY_INFO[key].startswith(prefix + b"-early"))


def assert_no_repeat() -> None:
    seen: set[tuple[bytes, bytes]] = set()
    for pair in SEALS:
        assert pair not in seen, f"(key, nonce) sealed twice: nonce {pair[1].hex()}"
        seen.add(pair)


steps = st.lists(
    st.tuples(st.sampled_from(["handoff", "restart", "replay_offers", "replay_all"]), st.sampled_from(SIDS)),
    max_size=5,
)
# At least one handoff in every story (anywhere in it): each story has seals of its own in both directions.
story = st.builds(lambda before, sid, after: [*before, ("handoff", sid), *after],
                  steps, st.sampled_from(SIDS), steps)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(story)
def test_no_key_nonce_pair_is_sealed_twice(steps: list[tuple[str, int]]) -> None:
    first = len(SEALS)  # this example's seals are SEALS[first:]
    endpoint = new_endpoint()
    captured: list[bytes] = []
    now = 0.0
    for action, sid in steps:
        if action == "handoff":  # a new sender process (fresh R_s), maybe an old session id
            now = run_handoff(new_sender(sid, 12), endpoint, now, captured) + 1.0
        elif action == "restart":
            endpoint = new_endpoint()
        elif action == "replay_offers":
            now = replay(endpoint, [d for d in captured if d[1] & 0x3F == 4], now)
        else:
            now = replay(endpoint, captured, now)
    assert_no_repeat()  # over every example so far, not only this one
    # The story's first handoff meets an endpoint that has seen nothing (replays before it replay nothing),
    # so it completes: both sides sealed under their session keys, and the recorder saw it.
    own = SEALS[first:]
    assert session_key_seals(own, b"s2r") > 0, steps
    assert session_key_seals(own, b"r2s") > 0, steps
