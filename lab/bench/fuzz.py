"""`pfec bench fuzz`: mutated datagrams through both endpoints' receive paths (issue 12).

A rig holds one live, authenticated handoff in mid-stream, sans-IO: a ``ReceiverEndpoint`` with an
established session (and whatever pending handshakes the inputs create) and the ``SenderSession`` talking
to it. Its corpus is every datagram type both ways, captured from that handoff and two side handoffs (a
refused OFFER, a multi-part OFFER): OFFER (handshake and session phase), early and session SOURCE,
REPAIR, CLOSE; ACCEPT, REFUSE (handshake and session phase), ACK, RESULT, CLOSE.

Each input is one mutation of corpus datagrams (bit flips, truncation, splicing two datagrams, a rewritten
header field, a verbatim replay, random bytes) or, for a tenth of the inputs, a datagram a key holder
crafted (random ACK fields sealed with the receiver's session key; random SOURCE/REPAIR/OFFER fields
sealed with the sender's), sent in either direction. After every input the rig drains the side's events
and output, and now and then fires its timers and asks the sender for datagrams, so that what an input
changed is exercised too. Counted: inputs, inputs/s, escapes (any exception out of a session or endpoint
method: must be 0), hangs (an input that took longer than ``HANG_S``), the drop reasons, RSS before and
after.
"""

from __future__ import annotations

import json
import random
import resource
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfec.common.sched.policies import DeficitHeuristic
from pfec.common.wire.frames import peek_header
from pfec.common.wire.messages import Ack, Close, CloseCode, Offer, Refuse, RefuseCode, Result, Role
from pfec.common.wire.seal import Keyring, PacketProtector
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, ReceiverConfig
from pfec.sender.transport.session import SenderConfig, SenderSession, SenderState

PSK = bytes(range(32))
FINGERPRINT = b"pfec-fuzz".ljust(32, b"\0")
SYMBOL = 64
N_SOURCE = 4000
SID = 0x0F0F_0000_0000_0001
HANG_S = 0.25  # one input taking longer than this is a hang
DEFAULT_INPUTS = 1_000_000
_SLOT = 1e-4
_OWD = 0.002


def _rss_kib() -> int:
    """Current resident set size in KiB (/proc/self/statm), 0 where unavailable."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * resource.getpagesize() // 1024


@dataclass
class FuzzStats:
    inputs: int = 0
    to_receiver: int = 0
    to_sender: int = 0
    crafted: int = 0
    escapes: int = 0
    hangs: int = 0
    slowest_s: float = 0.0
    escape_samples: list[str] = field(default_factory=list)


class FuzzRig:
    """One live handoff and its corpus; :meth:`feed` throws ``n`` inputs at it (see the module doc)."""

    def __init__(self, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.nprng = np.random.default_rng(seed)
        self.now = 0.0
        self.keyring = Keyring(PSK)
        self.endpoint = ReceiverEndpoint(
            self.keyring, FINGERPRINT, ReceiverConfig(ack_every=4, handshake_timeout_s=0.5),
            random_bytes=random.Random(seed * 7 + 1).randbytes,
        )
        self.symbols = self.nprng.integers(0, 256, size=(N_SOURCE, SYMBOL), dtype=np.uint8)
        self.sid = SID
        self.handoffs = 0
        self.s2r: list[bytes] = []
        self.r2s: list[bytes] = []
        self.sender = self._new_handoff()
        self._capture_side_handoffs(seed)
        self.stats = FuzzStats()

    # ------------------------------------------------------------------ corpus
    def _new_handoff(self) -> SenderSession:
        """A new live handoff (the inputs may end the last one: an authentic CLOSE, a crafted OFFER...),
        run into mid-stream with a few losses (repairs, ACKs with holes), capturing both ways."""
        self.handoffs += 1
        self.sid = SID + 16 * self.handoffs
        self.sender = sender = SenderSession(
            self.sid,
            SenderConfig(budget_s=30.0, slot_s=_SLOT, owd_s=_OWD, repair_budget=N_SOURCE,
                         fingerprint=FINGERPRINT, window_cap=32, app_blob=bytes(range(256)) * 8,
                         first_flight=64, result_wait_s=1.0),
            self.symbols,
            DeficitHeuristic(),
            PacketProtector(self.keyring, self.sid, Role.SENDER, SYMBOL,
                            random_bytes=random.Random(self.rng.getrandbits(64)).randbytes),
        )
        if len(self.s2r) > 4000:  # bounded corpus: the newest handoffs'
            del self.s2r[:2000]
            del self.r2s[: len(self.r2s) // 2]
        self._capture_handoff()
        return sender

    def _capture_handoff(self) -> None:
        sender, endpoint = self.sender, self.endpoint
        sender.start(self.now)
        lost = {70, 71, 90, 140, 141, 142}
        sent = 0
        for _ in range(400):
            self.now += _SLOT
            datagram = sender.next_datagram(self.now)
            if datagram is not None:
                self.s2r.append(datagram)
                sent += 1
                if sent not in lost:
                    endpoint.receive_datagram(datagram, self.now)
            self._drain_receiver(capture=True)
            if sender.get_timer() is not None and sender.get_timer() <= self.now:  # type: ignore[operator]
                sender.handle_timer(self.now)
        session = endpoint.sessions.get(self.sid)
        if session is None:
            raise RuntimeError(f"fuzz rig: the handoff did not establish (drops {endpoint.drops})")
        # Types the handoff does not send by itself, sealed by the live protectors (so they are authentic).
        self.r2s.append(session.protector.seal(Close(CloseCode.ERROR, "fuzz corpus")))
        self.r2s.append(session.protector.seal(Refuse(RefuseCode.OTHER, "fuzz corpus")))
        self.r2s.extend(session.protector.seal(Result(5, i, 2, b"fuzz" * 100)) for i in range(2))
        self.s2r.append(sender.protector.seal(Close(CloseCode.CANCELLED, "fuzz corpus")))

    def _capture_side_handoffs(self, seed: int) -> None:
        """A refused OFFER (handshake REFUSE) and the early datagrams of an unknown session."""
        other = SenderSession(
            SID + 1,
            SenderConfig(budget_s=1.0, slot_s=_SLOT, owd_s=_OWD, repair_budget=0, fingerprint=b"x" * 32),
            self.nprng.integers(0, 256, size=(8, SYMBOL), dtype=np.uint8),
            DeficitHeuristic(),
            PacketProtector(self.keyring, SID + 1, Role.SENDER, SYMBOL,
                            random_bytes=random.Random(seed * 7 + 3).randbytes),
        )
        other.start(self.now)
        while (datagram := other.next_datagram(self.now)) is not None:
            self.s2r.append(datagram)
            self.endpoint.receive_datagram(datagram, self.now)
        self.r2s.extend(d for _sid, d in self.endpoint.datagrams_to_send())

    # ------------------------------------------------------------------ inputs
    def _mutate(self, corpus: list[bytes]) -> bytes:
        rng = self.rng
        base = bytearray(rng.choice(corpus))
        kind = rng.randrange(6)
        if kind == 0:  # bit flips
            for _ in range(rng.randint(1, 8)):
                pos = rng.randrange(len(base))
                base[pos] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncation
            del base[rng.randrange(len(base) + 1):]
        elif kind == 2:  # splice two datagrams
            other = rng.choice(corpus)
            base = base[: rng.randrange(len(base) + 1)] + other[rng.randrange(len(other) + 1):]
        elif kind == 3:  # a header field rewritten (type byte, session id, packet number)
            what = rng.randrange(3)
            if what == 0 and len(base) > 1:
                base[1] = rng.randrange(256)
            elif what == 1 and len(base) >= 10:
                base[2:10] = rng.choice([self.sid, SID + 1, rng.getrandbits(64)]).to_bytes(8, "big")
            elif len(base) >= 14:
                base[10:14] = rng.getrandbits(32).to_bytes(4, "big")
        elif kind == 4:  # a verbatim replay
            pass
        else:  # random bytes
            base = bytearray(rng.randbytes(rng.randrange(1, 1500)))
        return bytes(base)

    def _crafted_to_receiver(self) -> bytes:
        """A key holder's datagram with random fields (sealed with the sender's live protector)."""
        rng = self.rng
        protector = self.sender.protector
        kind = rng.randrange(3)
        if kind == 0:
            return protector.seal_source(rng.getrandbits(32), rng.randbytes(SYMBOL))
        if kind == 1:
            return protector.seal_repair(rng.getrandbits(16), rng.randrange(16), rng.randint(1, 4095),
                                         rng.getrandbits(32), rng.randbytes(SYMBOL))
        pc = rng.randint(1, 0xFFFF)
        offer = Offer(rng.randint(1, 1362), rng.getrandbits(16), rng.getrandbits(32), rng.getrandbits(32),
                      rng.choice([FINGERPRINT, rng.randbytes(32)]), rng.randrange(pc), pc, rng.randbytes(40),
                      protector.local_random)
        return protector.seal(offer)

    def _crafted_to_sender(self) -> bytes:
        """Random ACK fields sealed with the receiver session's key (what a buggy or hostile peer sends)."""
        session = self.endpoint.sessions.get(self.sid)
        if session is None:
            return self._mutate(self.r2s)
        return session.protector.seal(random_ack(self.rng))

    def feed(self, n: int, progress: Callable[[int, int], None] | None = None) -> FuzzStats:
        stats = self.stats
        rng = self.rng
        clock = time.perf_counter
        for i in range(n):
            to_receiver = rng.random() < 0.5
            crafted = rng.random() < 0.1
            t0 = clock()
            try:
                if to_receiver:
                    datagram = self._crafted_to_receiver() if crafted else self._mutate(
                        self.s2r if rng.random() < 0.9 else self.r2s)
                    self.endpoint.receive_datagram(datagram, self.now)
                    self._drain_receiver(capture=False)
                else:
                    datagram = self._crafted_to_sender() if crafted else self._mutate(
                        self.r2s if rng.random() < 0.9 else self.s2r)
                    self.sender.receive_datagram(datagram, self.now)
                    self._drain_sender()
                if i % 64 == 63:
                    self._tick()
            except Exception as exc:  # an escape: exactly what this benchmark counts
                stats.escapes += 1
                if len(stats.escape_samples) < 5:
                    stats.escape_samples.append("".join(traceback.format_exception_only(exc)).strip())
            elapsed = clock() - t0
            if i % 64 == 63:
                self._keep_alive()  # the rig's own step (a failure here is the rig's, raised)
            stats.slowest_s = max(stats.slowest_s, elapsed)
            if elapsed > HANG_S:
                stats.hangs += 1
            stats.inputs += 1
            stats.to_receiver += to_receiver
            stats.to_sender += not to_receiver
            stats.crafted += crafted
            if progress is not None and (i + 1) % 50_000 == 0:
                progress(i + 1, n)
        return stats

    # ------------------------------------------------------------------ plumbing
    def _drain_receiver(self, capture: bool) -> None:
        endpoint = self.endpoint
        while (event := endpoint.next_event()) is not None:
            if isinstance(event, DeadlineReached):
                session = endpoint.sessions.get(event.session_id)
                if session is not None:
                    session.send_result(b"{}", self.now)
        for _sid, datagram in endpoint.datagrams_to_send():
            if capture:
                self.r2s.append(datagram)
                self.sender.receive_datagram(datagram, self.now)

    def _drain_sender(self) -> None:
        while self.sender.next_event() is not None:
            pass

    def _tick(self) -> None:
        """Time moves a little: timers fire, the sender sends a few datagrams (the receiver gets them)."""
        self.now += 0.001
        for side in (self.sender, self.endpoint):
            timer = side.get_timer()
            if timer is not None and timer <= self.now:
                side.handle_timer(self.now)
        for _ in range(4):
            datagram = self.sender.next_datagram(self.now)
            if datagram is None:
                break
            self.endpoint.receive_datagram(datagram, self.now)
        self._drain_receiver(capture=False)
        self._drain_sender()

    def _keep_alive(self) -> None:
        """The inputs may end the handoff (an authentic CLOSE or REFUSE replayed once is legitimate): then
        close what is left of it and start the next, so that inputs keep meeting a live session."""
        sender, endpoint = self.sender, self.endpoint
        if sender.state not in (SenderState.DONE, SenderState.FAILED) and self.sid in endpoint.sessions:
            return
        if self.sid in endpoint.sessions and sender.protector.has_session_keys:
            close = sender.protector.seal(Close(CloseCode.CANCELLED, "next handoff"))
            endpoint.receive_datagram(close, self.now)
            self._drain_receiver(capture=False)
        self._new_handoff()


def random_ack(rng: random.Random) -> Ack:
    """An ACK whose every field is random within its wire range (extremes favoured)."""

    def u32() -> int:
        return rng.choice([0, 1, 0xFFFF_FFFF, rng.getrandbits(32), rng.randrange(200)])

    def u16() -> int:
        return rng.choice([0, 1, 0xFFFF, rng.getrandbits(16), rng.randrange(50)])

    hole_bits = rng.choice([0, 1, 4096, rng.randrange(4097)])
    return Ack(u32(), u32(), u32(), u16(), u16(), u32(), u32(), u32(), u32(), u32(), hole_bits,
               rng.randbytes((hole_bits + 7) // 8))


def run_fuzz_bench(inputs: int = DEFAULT_INPUTS, seed: int = 1,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Build a rig, feed it ``inputs`` mutated datagrams, report (see the module doc)."""
    if inputs < 1:
        raise ValueError(f"inputs must be >= 1, got {inputs!r}")
    rig = FuzzRig(seed)
    rig.feed(min(2000, inputs))  # warm-up: first-use costs (kernel compiles) are not per-input costs
    rig.stats = FuzzStats()
    rss0 = _rss_kib()
    maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    stats = rig.feed(inputs, progress)
    wall = time.perf_counter() - t0
    rss1 = _rss_kib()
    maxrss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counted = stats.inputs
    drops = {"receiver": dict(sorted(rig.endpoint.drops.items())),
             "sender": dict(sorted(rig.sender.drops.items()))}
    return {
        "inputs": counted,
        "seed": seed,
        "wall_s": round(wall, 3),
        "inputs_per_s": round(counted / wall, 1),
        "escapes": stats.escapes,
        "escape_samples": stats.escape_samples,
        "hangs": stats.hangs,
        "hang_bound_s": HANG_S,
        "slowest_input_ms": round(stats.slowest_s * 1e3, 3),
        "to_receiver": stats.to_receiver,
        "to_sender": stats.to_sender,
        "crafted_by_key_holder": stats.crafted,
        "corpus": {"s2r": len(rig.s2r), "r2s": len(rig.r2s),
                   "types_s2r": sorted({peek_header(d).type.name for d in rig.s2r}),
                   "types_r2s": sorted({peek_header(d).type.name for d in rig.r2s})},
        "rss_kib_before": rss0,
        "rss_kib_after": rss1,
        "rss_growth_kib": rss1 - rss0,
        "maxrss_kib_before": maxrss0,
        "maxrss_kib_after": maxrss1,
        "pending_handshakes_after": len(rig.endpoint.pending_handshakes()),
        "sessions_after": len(rig.endpoint.sessions),
        "handoffs": rig.handoffs,
        "drops": drops,
    }


def write_fuzz_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fuzz.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result.get("machine", {})
    top = sorted(result["drops"]["receiver"].items(), key=lambda kv: -kv[1])[:8]
    lines = [
        "# Fuzz benchmark (`pfec bench fuzz`)",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, Python {m.get('python', '?')}.",
        "",
        "Mutated datagrams (bit flips, truncation, splicing, rewritten header fields, replays, random bytes;"
        " a tenth crafted and sealed by a key holder) into a live receiver endpoint and sender session.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| inputs | {result['inputs']} ({result['to_receiver']} to the receiver, {result['to_sender']} to "
        f"the sender, {result['crafted_by_key_holder']} crafted by a key holder) |",
        f"| inputs/s | {result['inputs_per_s']:.0f} |",
        f"| escapes (must be 0) | {result['escapes']} |",
        f"| hangs (> {result['hang_bound_s'] * 1e3:.0f} ms for one input; must be 0) | {result['hangs']} |",
        f"| slowest input | {result['slowest_input_ms']:.2f} ms |",
        f"| RSS before / after / growth | {result['rss_kib_before']} / {result['rss_kib_after']} / "
        f"{result['rss_growth_kib']} KiB |",
        f"| pending handshakes left | {result['pending_handshakes_after']} |",
        "",
        "Receiver drops, most frequent: " + ", ".join(f"{k} {v}" for k, v in top) + ".",
        "",
    ]
    (out_dir / "fuzz.md").write_text("\n".join(lines))


__all__ = ["DEFAULT_INPUTS", "FuzzRig", "FuzzStats", "random_ack", "run_fuzz_bench", "write_fuzz_bench"]
