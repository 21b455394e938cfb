"""The speed query (sans-IO, both ends): a sender asks a receiver its prefill speed before the first
handoff it plans; the receiver answers from its statement and keeps no session; what is lost is tried
again, what is forged, replayed or implausible is dropped and counted."""

from __future__ import annotations

import random

import pytest

from pfec.common.plan.breakeven import DEFAULT_MODEL_PREFILL
from pfec.common.plan.prefill import PrefillCurve
from pfec.common.plan.receiver_speed import stated_fields
from pfec.common.wire.messages import Offer
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.handshake import AMPLIFICATION_FACTOR
from pfec.receiver.session import ReceiverConfig
from pfec.sender.transport.speed_query import MIN_RETRY_S, QUERY_TRIES, SpeedQuery

PSK = b"k" * 32
FP = b"f" * 32
SID = 0x5EED_0001
CURVE = PrefillCurve(0.02, 3e-4, 2e-8)


def _endpoint(statement: tuple[int, int, int, int] | None = None,
              fingerprint: bytes = FP) -> ReceiverEndpoint:
    endpoint = ReceiverEndpoint(PSK, fingerprint, ReceiverConfig(), random_bytes=random.Random(2).randbytes)
    endpoint.prefill_statement = stated_fields(CURVE, 0.004) if statement is None else statement
    return endpoint


def _query(now: float = 0.0) -> SpeedQuery:
    return SpeedQuery(PSK, FP, SID, now, 0.01, random_bytes=random.Random(1).randbytes)


def _replies(endpoint: ReceiverEndpoint) -> list[bytes]:
    return [datagram for _sid, datagram in endpoint.datagrams_to_send()]


def test_the_receiver_states_its_speed_and_keeps_no_session() -> None:
    endpoint, query = _endpoint(), _query()
    datagram = query.datagram(0.0)
    assert datagram is not None
    endpoint.receive_datagram(datagram, 0.001)
    replies = _replies(endpoint)
    # within the handshake's amplification bound (the ACCEPT states thirteen numbers: 116 B against 108 B)
    assert len(replies) == 1 and len(replies[0]) <= AMPLIFICATION_FACTOR * len(datagram)
    assert not endpoint.sessions and not endpoint.pending_handshakes() and endpoint.speed_queries == 1
    query.receive(replies[0], 0.012)
    answer = query.answer
    assert answer is not None and answer.receiver is not None, answer
    assert answer.receiver.prefill.b == pytest.approx(CURVE.b) and answer.receiver.decode_s == 0.004
    assert answer.rtt_s == 0.012 and query.timer is None
    # A replay of the query gets no second answer: dropped as a closed session, counted.
    endpoint.receive_datagram(datagram, 0.02)
    assert not _replies(endpoint) and endpoint.drops.get("closed_session") == 1


def test_a_lost_query_is_tried_again_and_then_given_up_with_a_reason() -> None:
    query = _query()
    sent = [query.datagram(0.0)]
    assert query.datagram(0.01) is None  # not due yet
    retry = query.timer
    assert retry == MIN_RETRY_S
    while (wake := query.timer) is not None:
        datagram = query.datagram(wake)
        if datagram is not None:
            sent.append(datagram)
        query.expire(wake)
    assert len(sent) == QUERY_TRIES and len(set(sent)) == QUERY_TRIES  # fresh packet numbers
    assert query.answer is not None and query.answer.receiver is None and query.answer.rtt_s is None
    assert query.answer.why == f"no answer to {QUERY_TRIES} speed queries"


def test_an_answer_to_a_retried_query_is_no_rtt_sample() -> None:
    endpoint, query = _endpoint(), _query()
    query.datagram(0.0)
    retried = query.datagram(MIN_RETRY_S)
    assert retried is not None
    endpoint.receive_datagram(retried, MIN_RETRY_S + 0.001)
    query.receive(_replies(endpoint)[0], MIN_RETRY_S + 0.01)
    assert query.answer is not None and query.answer.receiver is not None and query.answer.rtt_s is None


def test_no_statement_another_model_and_an_implausible_statement_leave_the_stored_curve() -> None:
    for endpoint, why in ((_endpoint((0, 0, 0, 0)), "the receiver states no speed"),
                          (_endpoint(fingerprint=b"g" * 32), "refused (FINGERPRINT_MISMATCH)")):
        query = _query()
        datagram = query.datagram(0.0)
        assert datagram is not None
        endpoint.receive_datagram(datagram, 0.001)
        query.receive(_replies(endpoint)[0], 0.002)
        assert query.answer is not None and query.answer.receiver is None, query.answer
        assert query.answer.why.startswith(why), query.answer.why
        assert not endpoint.sessions
    # An implausible curve (no per-token cost) is planned on the stored curve, and says so.
    endpoint, query = _endpoint((5, 0, 0, 7)), _query()
    datagram = query.datagram(0.0)
    assert datagram is not None
    endpoint.receive_datagram(datagram, 0.001)
    query.receive(_replies(endpoint)[0], 0.002)
    answer = query.answer
    assert answer is not None and answer.receiver is not None
    assert answer.receiver.prefill == DEFAULT_MODEL_PREFILL and "prefill" in answer.receiver.defaulted


def test_forged_and_foreign_replies_are_dropped_and_counted() -> None:
    query = _query()
    datagram = query.datagram(0.0)
    assert datagram is not None
    query.receive(b"\x00" * 80, 0.001)
    query.receive(datagram, 0.001)  # our own datagram reflected back
    other = SpeedQuery(PSK, FP, SID + 1, 0.0, 0.01, random_bytes=random.Random(9).randbytes)
    endpoint = _endpoint()
    other_datagram = other.datagram(0.0)
    assert other_datagram is not None
    endpoint.receive_datagram(other_datagram, 0.001)
    query.receive(_replies(endpoint)[0], 0.002)  # an answer bound to another query's R_s
    assert query.answer is None and sum(query.drops.values()) == 3, query.drops
    endpoint.receive_datagram(datagram, 0.003)
    query.receive(_replies(endpoint)[0], 0.004)
    assert query.answer is not None and query.answer.receiver is not None


def test_a_query_with_parts_or_application_data_is_refused() -> None:
    for extra in ({"app": b"x"}, {"part_count": 2}):
        endpoint, query = _endpoint(), _query()
        offer = Offer(1362, 0, 0, 0, FP, sender_random=query.protector.local_random, **extra)  # type: ignore[arg-type]
        endpoint.receive_datagram(query.protector.seal(offer), 0.0)
        assert endpoint.speed_queries == 0 and not endpoint.pending_handshakes()
        query.sent_at.append(0.0)
        query.receive(_replies(endpoint)[0], 0.001)
        assert query.answer is not None and query.answer.why.startswith("refused (BAD_PARAMETERS)"), extra
