"""What this receiver's receive path takes per datagram, measured on itself (the planner's ``datagram_s``).

A split's front is computed while the back's stream arrives; where the receive path and the model share a
core (a node pinned to one, as the demo runs it), each datagram takes its CPU from the front, which then
runs ``1 / (1 - u)`` slower (``breakeven.ReceiverModel.stream_factor``, u the receive path's share). The
receiver times that cost on its own code, not a constant: a synthetic stream of ``DATAGRAMS`` source
symbols, sealed here with a sender's keys, goes over a loopback socket pair into a private
``ReceiverEndpoint`` (the daemon's receive path: recvmsg, header, AEAD open, the session's table, the
decoder, its ACKs sealed and sent), in batches of ``BATCH`` as the daemon reads them; only the receiving
side's work is timed (this thread's CPU time), and divided by the share of a CPU the pass got (its CPU
time over its wall time, at most 1): under a CPU quota q, or beside other busy processes, the path's c
CPU-seconds per datagram take c / q of the node's time, and the front, sharing that CPU, loses the share
u = r c / q at r datagrams a second. The median of ``REPEATS`` passes. It runs at start-up and with every
re-measurement of the prefill speed (``ReceiverDaemon.measure_prefill_speed``), in the same worker, so a
CPU quota or a loaded core shows in it as it does in the prefill curve.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Final

from pfec.common.wire.messages import DEFAULT_SYMBOL_SIZE, Accept, Offer, Role
from pfec.common.wire.seal import PacketProtector
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session_types import ReceiverConfig

__all__ = ["BATCH", "DATAGRAMS", "REPEATS", "receive_path_s", "time_receive_path"]

DATAGRAMS: Final = 1024
BATCH: Final = 64  # datagrams sent into the socket before the receiving side reads them
REPEATS: Final = 5
_SESSION_ID: Final = 0x5EED_5EED_0000_0001
_BUDGET_US: Final = 30_000_000
_SLOT_S: Final = 1396 * 8 / 100e6  # synthetic arrival times: the default symbol at 100 Mbit/s


def _established(psk: bytes, fingerprint: bytes, n_source: int) -> tuple[ReceiverEndpoint, PacketProtector]:
    """A private endpoint with one session past its handshake, and the sender's protector for it."""
    endpoint = ReceiverEndpoint(psk, fingerprint, ReceiverConfig())
    sender = PacketProtector(psk, _SESSION_ID, Role.SENDER, DEFAULT_SYMBOL_SIZE)
    offer = Offer(DEFAULT_SYMBOL_SIZE, 64, n_source, _BUDGET_US, fingerprint,
                  sender_random=sender.local_random)
    endpoint.receive_datagram(sender.seal(offer), 0.0)
    replies = [datagram for _sid, datagram in endpoint.datagrams_to_send()]
    accepts = [message for message in (sender.open(d)[1] for d in replies) if isinstance(message, Accept)]
    if not accepts:
        raise RuntimeError("the private endpoint did not accept the synthetic OFFER")
    sender.set_peer_random(accepts[0].receiver_random)
    return endpoint, sender


def _one_pass(psk: bytes, fingerprint: bytes, n_datagrams: int, batch: int) -> float:
    """Seconds of this node's time per datagram received, over one synthetic stream: the receiving side's
    CPU time per datagram over the share of a CPU the whole pass got."""
    endpoint, sender = _established(psk, fingerprint, n_datagrams)
    payload = os.urandom(DEFAULT_SYMBOL_SIZE)
    datagrams = [sender.seal_source(esi, payload) for esi in range(n_datagrams)]
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        tx.bind(("127.0.0.1", 0))
        address, sink = rx.getsockname(), tx.getsockname()  # the ACKs go to the sender's socket, unread
        pass_cpu, pass_wall = time.thread_time(), time.perf_counter()
        spent = 0.0
        received = 0
        for start in range(0, n_datagrams, batch):
            sent = datagrams[start : start + batch]
            for datagram in sent:
                tx.sendto(datagram, address)
            began = time.thread_time()
            for i in range(len(sent)):
                try:
                    data = rx.recv(2048)
                except BlockingIOError:  # the loopback dropped it (a full buffer): not our cost
                    break
                endpoint.receive_datagram(data, (start + i) * _SLOT_S)
                received += 1
            while endpoint.next_event() is not None:  # the daemon's service: events, then its ACKs
                pass
            for _sid, reply in endpoint.datagrams_to_send():
                rx.sendto(reply, sink)
            spent += time.thread_time() - began
    finally:
        rx.close()
        tx.close()
        pass_cpu, pass_wall = time.thread_time() - pass_cpu, time.perf_counter() - pass_wall
    if received == 0 or pass_wall <= 0:
        raise RuntimeError("no synthetic datagram reached the private endpoint")
    share = min(1.0, max(0.01, pass_cpu / pass_wall))
    return spent / received / share


def time_receive_path(n_datagrams: int = DATAGRAMS, batch: int = BATCH, repeats: int = REPEATS) -> float:
    """The receive path's time per datagram on this node (seconds, the median of ``repeats`` passes; a
    fresh key each pass: the cost does not depend on it, and no peer ever holds it)."""
    if n_datagrams < 1 or batch < 1 or repeats < 1:
        raise ValueError(f"datagrams {n_datagrams!r}, batch {batch!r}, repeats {repeats!r} must be >= 1")
    return statistics.median(_one_pass(os.urandom(32), bytes(32), n_datagrams, batch) for _ in range(repeats))


def receive_path_s() -> float | None:
    """``time_receive_path`` with the defaults, or None where this node cannot time it (no loopback
    socket): its ACCEPT then states none, and the sender plans with the conservative default."""
    try:
        return time_receive_path()
    except (OSError, RuntimeError):
        return None
