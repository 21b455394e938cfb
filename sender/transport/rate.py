"""Where a rate controller plugs into a sender session (sans-IO): the ``RateController`` interface and
``FixedRate``, today's rate logic (pace at the configured rate, whatever the feedback says).

The interface follows aioquic's congestion controllers (``quic/congestion/base.py``, fed by its loss
recovery): the session's parts report what happens on the path, the controller answers how fast to send.

- ``slot_s``: the link time of one full-size datagram at the rate the controller allows now (the OFFER
  repeat timer, the link adapters' pacing); ``plan_slot_s`` the same at the rate the controller forecasts
  with confidence, read whenever the session counts the transmission slots left before its send deadline
  (each decision epoch, at ``start``);
- ``on_packet_sent(now, size)``: the send path (``send_path``), for every data datagram (source or repair)
  it hands to the link;
- ``on_packets_acked(now, count)``: the in-flight records (``inflight``), with the data datagrams an ACK
  newly covers (sent at or before the ACK's largest packet number);
- ``on_packets_lost(now, count)``: the ACK intake (``path``), with the growth of the receiver's cumulative
  loss counter (losses the FEC repaired count too: random loss is the code's business, but a loss rate
  above its floor is congestion, RFC 9265);
- ``on_packets_delivered(now, count)``: the ACK intake, with the growth of the receiver's cumulative count
  of data datagrams received (the delivery rate's numerator);
- ``on_rtt_measurement(now, rtt, sent_at)``: the ACK intake, before the same ACK's counts, with each RTT
  sample and the send time of the packet it is of (the newest acknowledged packet,
  less the ACK delay);
- ``write_off(count)``: the ACK intake, once, when the session ends (done or failed), with the data
  datagrams it sent that no ACK counted as received or lost;
- ``breaker(now)``: read each decision epoch; a reason stops the stream (RFC 8084's circuit breaker: the
  session tells the receiver it is done, with ``DoneReason.PATH_BROKEN``).

One controller may serve several sessions at once (concurrent handoffs to one receiver share one path):
its hooks then see every session's packets, and each session reads the shared ``slot_s``.
``transfer.py`` builds a ``FixedRate`` from the session's config unless the caller passes one;
:mod:`.path_rate` holds the measuring controller, ``PathRate``, whose ``pacing_bps`` the link adapters
(``sender/pacer.py``'s ``LinkClock``, ``lab/sim/engine.py``'s link) pace at; under a ``FixedRate`` they
pace at the configured rate.
"""

from __future__ import annotations

from typing import Protocol


class RateController(Protocol):
    """How fast a session may send, updated from what the session reports about its path."""

    @property
    def slot_s(self) -> float:
        """Link time of one full-size datagram at the rate allowed now (seconds, > 0)."""
        ...

    @property
    def plan_slot_s(self) -> float:
        """Link time of one full-size datagram at the rate the controller forecasts (seconds, > 0)."""
        ...

    def breaker(self, now: float) -> str | None:
        """Why the path is given up (the stream stops), or None."""
        ...

    def on_packet_sent(self, now: float, size: int) -> None:
        """A data datagram of ``size`` bytes left for the link at ``now``."""
        ...

    def on_packets_acked(self, now: float, count: int) -> None:
        """An ACK arriving at ``now`` newly covers ``count`` data datagrams."""
        ...

    def on_packets_lost(self, now: float, count: int) -> None:
        """An ACK arriving at ``now`` reports ``count`` more datagrams lost than any before it."""
        ...

    def on_packets_delivered(self, now: float, count: int) -> None:
        """An ACK arriving at ``now`` counts ``count`` more data datagrams received than any before it."""
        ...

    def on_rtt_measurement(self, now: float, rtt: float, sent_at: float) -> None:
        """One RTT sample (seconds, > 0) taken at ``now``, of the datagram sent at ``sent_at``."""
        ...

    def write_off(self, count: int) -> None:
        """A session ended with ``count`` data datagrams its receiver never counted (what followed its last
        ACK): they will never be, so they are no longer in flight."""
        ...


class FixedRate:
    """The configured rate, always: the slot the config gives, deaf to every report (today's behaviour,
    DESIGN.md: pacing at the told rate is the whole rate logic)."""

    __slots__ = ("plan_slot_s", "slot_s")

    def __init__(self, slot_s: float) -> None:
        if not slot_s > 0:
            raise ValueError(f"slot_s must be positive, got {slot_s!r}")
        self.slot_s = slot_s  # plain attributes: read at every decision epoch
        self.plan_slot_s = slot_s

    def breaker(self, now: float) -> str | None:
        return None

    def on_packet_sent(self, now: float, size: int) -> None:
        pass

    def on_packets_acked(self, now: float, count: int) -> None:
        pass

    def on_packets_lost(self, now: float, count: int) -> None:
        pass

    def on_packets_delivered(self, now: float, count: int) -> None:
        pass

    def on_rtt_measurement(self, now: float, rtt: float, sent_at: float) -> None:
        pass

    def write_off(self, count: int) -> None:
        pass
