"""Tests for common.wire: layouts (frames), protection and the replay window (seal), hostile input."""

from __future__ import annotations

import ast
import random
import struct
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfec.common.wire import encoding, frames, seal
from pfec.common.wire import messages as wire_messages
from pfec.common.wire.encoding import encode_body
from pfec.common.wire.frames import decode_body, peek_header
from pfec.common.wire.messages import (
    DEFAULT_SYMBOL_SIZE,
    HEADER_SIZE,
    MAX_DATAGRAM,
    MAX_TEXT,
    PARSE_REASONS,
    TAG_SIZE,
    WIRE_VERSION,
    Accept,
    Ack,
    Close,
    CloseCode,
    Header,
    KeyPhase,
    Message,
    MsgType,
    Offer,
    ParseError,
    Refuse,
    RefuseCode,
    Repair,
    Result,
    Role,
    Source,
    clip_text,
    max_app_chunk,
    split_app,
)
from pfec.common.wire.seal import (
    AuthError,
    Keyring,
    MalformedError,
    PacketProtector,
    ReplayError,
    keyring_for,
    open_handshake,
    seal_handshake,
)

PSK = bytes(range(32))
OTHER_PSK = bytes(range(1, 33))
SID = 0x0123_4567_89AB_CDEF
SS = DEFAULT_SYMBOL_SIZE
R_S = bytes(range(100, 116))  # the sender's handshake random in these tests
R_R = bytes(range(200, 216))  # the receiver's

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
text = st.text(max_size=60)


def pair(
    ss: int | None = SS, *, auth: bool = True, sid: int = SID, window: int = 1024, psk: bytes = PSK,
    r_s: bytes = R_S, r_r: bytes = R_R,
) -> tuple[PacketProtector, PacketProtector]:
    """A sender and a receiver protector of an established session (both randoms known)."""
    kr = keyring_for(psk, auth)
    s = PacketProtector(kr, sid, Role.SENDER, ss, local_random=r_s, peer_random=r_r, replay_window=window)
    r = PacketProtector(kr, sid, Role.RECEIVER, ss, local_random=r_r, peer_random=r_s, replay_window=window)
    return s, r


def early_sender(ss: int = SS, *, auth: bool = True, sid: int = SID) -> PacketProtector:
    """A sender before the ACCEPT: OFFERs in the handshake phase, data under the early key."""
    return PacketProtector(keyring_for(PSK, auth), sid, Role.SENDER, ss, local_random=R_S)


def sample_messages(ss: int = SS) -> list[Message]:
    sym = bytes((i * 7) & 0xFF for i in range(ss))
    return [
        Source(5, sym),
        Repair(7, 3, 40, 1000, sym),
        Ack(10, 20, 15, 3, 2, 99, 1500, 400, 12, 4, 12, b"\xa5\x30", 777),
        Offer(ss, 256, 5000, 250_000, b"F" * 32, 0, 2, b"app-part-0", R_S, 2100),
        Accept(128, 5000, R_R),
        Refuse(RefuseCode.OVERLOADED, "busy ☃"),
        Result(4990, 1, 3, b"result bytes"),
        Close(CloseCode.DONE, "bye"),
    ]


def sender_of(msg: Message) -> Role:
    return Role.SENDER if msg.TYPE in (MsgType.SOURCE, MsgType.REPAIR, MsgType.OFFER) else Role.RECEIVER


def seal_open(msg: Message, *, ss: int = SS, auth: bool = True) -> tuple[bytes, Header, Message]:
    s, r = pair(ss, auth=auth)
    tx, rx = (s, r) if sender_of(msg) is Role.SENDER else (r, s)
    dg = tx.seal(msg)
    hdr, out = rx.open(dg)
    return dg, hdr, out


def hkdf(salt: bytes, info: bytes, psk: bytes = PSK) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(psk)


def session_key(
    direction: str, sid: int = SID, r_s: bytes = R_S, r_r: bytes = R_R, psk: bytes = PSK
) -> bytes:
    """K_s2r / K_r2s as the seal module documents them, computed here independently."""
    return hkdf(r_s + r_r, b"pfec/2 " + direction.encode() + struct.pack(">Q", sid), psk)


def forge(body: bytes, mtype: int, *, pn: int = 1, direction: str = "s2r", sid: int = SID) -> bytes:
    """An authentic session-phase datagram with an arbitrary (possibly malformed) body."""
    key = session_key(direction, sid)
    header = struct.pack(">BBQI", WIRE_VERSION, mtype, sid, pn)
    return header + AESGCM(key).encrypt(bytes(8) + struct.pack(">I", pn), body, header)


# --------------------------------------------------------------------------- layout


def test_constants_and_sizes() -> None:
    assert HEADER_SIZE == 14 and TAG_SIZE == 16 and MAX_DATAGRAM == 1400
    assert DEFAULT_SYMBOL_SIZE == 1362
    sizes = {type(m).__name__: len(seal_open(m)[0]) for m in sample_messages()}
    assert sizes["Source"] == 1396
    assert sizes["Repair"] == 1400
    assert sizes["Ack"] == 30 + 42 + 2
    assert sizes["Accept"] == 30 + 12 + 74  # a handshake datagram: explicit nonce, R_r, the stated speed
    assert sizes["Offer"] == 30 + 66 + len(b"app-part-0")  # once more under the session key
    assert len(early_sender().seal(sample_messages()[3])) == 30 + 12 + 66 + len(b"app-part-0")
    assert max_app_chunk(MsgType.OFFER) == 1292
    assert max_app_chunk(MsgType.RESULT) == 1362
    with pytest.raises(ValueError):
        max_app_chunk(MsgType.ACK)


def test_layout_is_big_endian_and_as_documented() -> None:
    s, _ = pair(16, auth=False)
    dg = s.seal(Repair(0x0102, 0xA, 0x0BC, 0x0D0E0F10, b"s" * 16))
    assert dg[:14] == bytes([WIRE_VERSION, 2]) + SID.to_bytes(8, "big") + (1).to_bytes(4, "big")
    early = early_sender(16, auth=False).seal(Repair(0x0102, 0xA, 0x0BC, 0x0D0E0F10, b"s" * 16))
    assert early[1] == 0x42  # the early phase in the type byte's top bits
    assert dg[14:22] == bytes([0x01, 0x02, 0xA0, 0xBC, 0x0D, 0x0E, 0x0F, 0x10])
    assert dg[22:38] == b"s" * 16 and dg[38:] == bytes(16)


def test_max_parts_fit_exactly() -> None:
    offer = Offer(SS, 1, 1, 1, bytes(32), 0, 1, b"x" * max_app_chunk(MsgType.OFFER), R_S)
    assert len(early_sender().seal(offer)) == MAX_DATAGRAM  # the handshake datagram, with its nonce
    assert len(seal_open(Result(1, 0, 1, b"x" * max_app_chunk(MsgType.RESULT)))[0]) == MAX_DATAGRAM
    _, r = pair()
    with pytest.raises(ValueError):
        too_long = b"x" * (max_app_chunk(MsgType.OFFER) + 1)
        early_sender().seal(Offer(SS, 1, 1, 1, bytes(32), 0, 1, too_long, R_S))
    with pytest.raises(ValueError):
        r.seal(Result(1, 0, 1, b"x" * (max_app_chunk(MsgType.RESULT) + 1)))


def test_clip_text() -> None:
    assert clip_text("abc") == "abc"
    long = "é" * 300  # 600 B of UTF-8
    clipped = clip_text(long)
    assert len(clipped.encode()) <= MAX_TEXT and clipped == "é" * 256
    assert clip_text("aé", 2) == "a"
    _, r = pair()
    r.seal(Refuse(RefuseCode.OTHER, clip_text(long)))


def test_split_app() -> None:
    n = max_app_chunk(MsgType.OFFER)
    blob = bytes(range(256)) * 20
    parts = split_app(blob, MsgType.OFFER)
    assert b"".join(parts) == blob and all(len(p) <= n for p in parts) and len(parts) == -(-len(blob) // n)
    assert split_app(b"", MsgType.RESULT) == [b""]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("auth", [True, False])
def test_sample_round_trip(auth: bool) -> None:
    for msg in sample_messages():
        dg, hdr, out = seal_open(msg, auth=auth)
        assert out == msg
        phase = KeyPhase.HANDSHAKE if msg.TYPE is MsgType.ACCEPT else KeyPhase.SESSION
        assert hdr == Header(WIRE_VERSION, msg.TYPE, SID, 1, phase)
        assert peek_header(dg) == hdr
        assert decode_body(msg.TYPE, encode_body(msg, SS), SS) == msg


def test_symbol_is_zero_copy_memoryview() -> None:
    for auth in (True, False):
        _, _, out = seal_open(Source(1, b"q" * SS), auth=auth)
        assert isinstance(out, Source) and isinstance(out.symbol, memoryview)
        assert out.symbol.nbytes == SS and bytes(out.symbol) == b"q" * SS
    # unauthenticated: a view into the datagram itself
    s, r = pair(8, auth=False)
    dg = bytearray(s.seal(Source(1, b"abcdefgh")))
    _, out = r.open(dg)
    assert isinstance(out, Source) and isinstance(out.symbol, memoryview)
    assert out.symbol.obj is dg


symbol_sizes = st.integers(1, DEFAULT_SYMBOL_SIZE)


@st.composite
def messages(draw: st.DrawFn) -> tuple[int, Message]:
    ss = draw(st.sampled_from([1, 2, 16, 1000, DEFAULT_SYMBOL_SIZE]))
    sym = draw(st.binary(min_size=ss, max_size=ss))
    kind = draw(st.integers(1, 8))
    msg: Message
    if kind == 1:
        msg = Source(draw(u32), sym)
    elif kind == 2:
        msg = Repair(draw(u16), draw(st.integers(0, 15)), draw(st.integers(1, 4095)), draw(u32), sym)
    elif kind == 3:
        msg = Ack(
            draw(u32),
            draw(u32),
            draw(u32),
            draw(u16),
            draw(u16),
            *(draw(u32) for _ in range(5)),
            9,
            b"\xff\x80",
            draw(u32),
        )
    elif kind == 4:
        pc = draw(st.integers(1, 0xFFFF))
        msg = Offer(
            draw(symbol_sizes),
            draw(u16),
            draw(u32),
            draw(u32),
            draw(st.binary(min_size=32, max_size=32)),
            draw(st.integers(0, pc - 1)),
            pc,
            draw(st.binary(max_size=max_app_chunk(MsgType.OFFER))),
            R_S,
            draw(u16),
        )
    elif kind == 5:
        msg = Accept(draw(u16), draw(u32), draw(st.binary(min_size=16, max_size=16)))
    elif kind == 6:
        msg = Refuse(draw(st.sampled_from(list(RefuseCode))), draw(text))
    elif kind == 7:
        pc = draw(st.integers(1, 0xFFFF))
        app = draw(st.binary(max_size=max_app_chunk(MsgType.RESULT)))
        msg = Result(draw(u32), draw(st.integers(0, pc - 1)), pc, app)
    else:
        msg = Close(draw(st.sampled_from(list(CloseCode))), draw(text))
    return ss, msg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), st.booleans())
def test_round_trip_property(case: tuple[int, Message], auth: bool) -> None:
    ss, msg = case
    dg, hdr, out = seal_open(msg, ss=ss, auth=auth)
    assert out == msg and hdr.type == msg.TYPE and len(dg) <= MAX_DATAGRAM
    assert decode_body(msg.TYPE, encode_body(msg), ss) == msg


def test_ack_saturates_u16_fields() -> None:
    _, _, out = seal_open(Ack(1, 2, 3, 70_000, 1 << 40, 4, 5, 6, 7, 8))
    assert isinstance(out, Ack) and out.deficit == 0xFFFF and out.unknowns == 0xFFFF


def test_packet_numbers_and_counters() -> None:
    s, r = pair()
    assert s.packets_sealed == 0 and r.largest_received_pn == 0
    dgs = [s.seal(Source(i, bytes(SS))) for i in range(5)]
    assert [peek_header(d).packet_number for d in dgs] == [1, 2, 3, 4, 5]
    assert s.packets_sealed == 5
    r.open(dgs[3])
    r.open(dgs[1])
    assert r.largest_received_pn == 4
    with pytest.raises(AttributeError):
        s.symbol_size = 10  # type: ignore[misc]


def test_seal_source_and_seal_repair_match_seal() -> None:
    sym = bytes((i * 7) & 0xFF for i in range(SS))
    for auth in (True, False):
        by_message, _ = pair(auth=auth)
        by_fields, _ = pair(auth=auth)
        assert by_message.seal(Source(5, sym)) == by_fields.seal_source(5, sym)
        assert by_message.seal(Repair(7, 3, 40, 1000, sym)) == by_fields.seal_repair(7, 3, 40, 1000, sym)
        assert by_fields.packets_sealed == 2
        with pytest.raises(ValueError):
            by_fields.seal_repair(7, 16, 40, 1000, sym)
        with pytest.raises(ValueError):
            by_fields.seal_source(1 << 32, sym)
        assert by_fields.packets_sealed == 2


@pytest.mark.parametrize("auth", [True, False])
def test_open_peeked_is_open_without_parsing_the_header_again(auth: bool) -> None:
    for msg in sample_messages():
        s, r = pair(auth=auth)
        tx, rx = (s, r) if sender_of(msg) is Role.SENDER else (r, s)
        fresh_s, fresh_r = pair(auth=auth)
        fresh_rx = fresh_r if rx is r else fresh_s
        dg = tx.seal(msg)
        header, out = rx.open(dg)
        assert peek_header(dg) == header
        assert fresh_rx.open_peeked(header, dg) == out == msg
        with pytest.raises(ReplayError):
            fresh_rx.open_peeked(header, dg)
    other_session, _ = pair(sid=SID + 1)
    dg = other_session.seal(Source(0, bytes(SS)))
    with pytest.raises(ParseError) as ei:
        pair()[1].open_peeked(peek_header(dg), dg)
    assert ei.value.reason == "wrong_session"


def test_receiver_learns_the_symbol_size_late() -> None:
    s, _ = pair(ss=100)
    _, r = pair(ss=None)
    data = s.seal(Source(0, bytes(100)))
    offer = Offer(100, 16, 10, 1000, bytes(32), sender_random=R_S)
    with pytest.raises(ParseError) as ei:
        r.open(data)  # no data before the size is known
    assert ei.value.reason == "bad_type"
    assert r.open(s.seal(offer))[1] == offer
    r.set_symbol_size(100)
    assert r.symbol_size == 100
    assert r.open(data)[1] == Source(0, bytes(100))
    with pytest.raises(ValueError):
        r.set_symbol_size(100)  # once only


# --------------------------------------------------------------------------- seal refuses


@pytest.mark.parametrize(
    "msg",
    [
        Source(-1, bytes(SS)),
        Source(1 << 32, bytes(SS)),
        Source(1, bytes(SS - 1)),
        Source(1, bytes(SS + 1)),
        Repair(1 << 16, 0, 1, 0, bytes(SS)),
        Repair(0, 16, 1, 0, bytes(SS)),
        Repair(0, -1, 1, 0, bytes(SS)),
        Repair(0, 0, 0, 0, bytes(SS)),
        Repair(0, 0, 4096, 0, bytes(SS)),
        Repair(0, 0, 1, 1 << 32, bytes(SS)),
        Repair(0, 0, 1, 0, bytes(10)),
        Offer(1 << 16, 1, 1, 1, bytes(32), sender_random=R_S),
        Offer(0, 1, 1, 1, bytes(32), sender_random=R_S),
        Offer(DEFAULT_SYMBOL_SIZE + 1, 1, 1, 1, bytes(32), sender_random=R_S),
        Offer(1, 1, 1, 1 << 32, bytes(32), sender_random=R_S),
        Offer(1, 1, 1, 1, bytes(31), sender_random=R_S),
        Offer(1, 1, 1, 1, bytes(32), 1, 1, sender_random=R_S),
        Offer(1, 1, 1, 1, bytes(32), 0, 0, sender_random=R_S),
        Offer(1, 1, 1, 1, bytes(32), 0, 1 << 16, sender_random=R_S),
        Offer(1, 1, 1, 1, bytes(32)),  # no R_s
        Offer(1, 1, 1, 1, bytes(32), sender_random=R_R),  # not this sender's R_s
        Offer(1, 1, 1, 1, bytes(32), sender_random=R_S, span=1 << 16),
        Close(CloseCode.DONE, "x" * 513),
        Close(9, "bad code"),  # type: ignore[arg-type]
    ],
)
def test_sender_seal_refuses_bad_fields(msg: Message) -> None:
    for s in (pair()[0], early_sender()):
        with pytest.raises(ValueError):
            s.seal(msg)
        assert s.packets_sealed == 0  # the packet number was not consumed


@pytest.mark.parametrize(
    "msg",
    [
        Ack(-1, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        Ack(1 << 32, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        Ack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, computed_tokens=1 << 32),
        Ack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, computed_tokens=-1),
        Ack(0, 0, 0, -1, 0, 0, 0, 0, 0, 0),
        Ack(0, 0, 0, 0, 0, 0, 1 << 32, 0, 0, 0),
        Accept(1 << 16, 0, R_R),
        Accept(1, 0),  # no R_r
        Accept(1, 0, bytes(15)),
        Refuse(RefuseCode.OTHER, "é" * 257),
        Refuse(0, ""),  # type: ignore[arg-type]
        Result(0, 2, 2),
        Result(1 << 32),
        Close(CloseCode.ERROR, 5),  # type: ignore[arg-type]
    ],
)
def test_receiver_seal_refuses_bad_fields(msg: Message) -> None:
    _, r = pair()
    with pytest.raises(ValueError):
        r.seal(msg)
    assert r.packets_sealed == 0


def test_seal_refuses_wrong_direction_and_non_messages() -> None:
    s, r = pair()
    with pytest.raises(ValueError):
        s.seal(Ack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError):
        r.seal(Source(0, bytes(SS)))
    with pytest.raises(ValueError):
        r.seal(Repair(0, 0, 1, 0, bytes(SS)))
    with pytest.raises(TypeError):
        s.seal(object())  # type: ignore[arg-type]
    s.seal(Close(CloseCode.CANCELLED))
    r.seal(Close(CloseCode.CANCELLED))


def test_constructor_validation() -> None:
    with pytest.raises(ValueError):
        PacketProtector(b"short", SID, Role.SENDER, SS)
    with pytest.raises(ValueError):
        PacketProtector(PSK, SID, Role.RECEIVER, SS)  # a receiver's needs R_s
    with pytest.raises(ValueError):
        PacketProtector(PSK, SID, Role.SENDER, SS, local_random=bytes(8))
    with pytest.raises(ValueError):
        PacketProtector(PSK, SID, Role.SENDER, SS, first_pn=0)
    with pytest.raises(ValueError):
        PacketProtector(PSK, -1, Role.SENDER, SS)
    with pytest.raises(ValueError):
        PacketProtector(PSK, 1 << 64, Role.SENDER, SS)
    for bad_ss in (0, DEFAULT_SYMBOL_SIZE + 1):
        with pytest.raises(ValueError):
            PacketProtector(PSK, SID, Role.SENDER, bad_ss)
    with pytest.raises(ValueError):
        PacketProtector(PSK, SID, Role.SENDER, SS, replay_window=0)
    with pytest.raises(ValueError):
        PacketProtector(PSK, SID, "sender", SS)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- keys


def test_keys_are_the_documented_hkdf_derivations() -> None:
    s, r = pair()
    sym = bytes(SS)
    dg = s.seal(Source(0, sym))
    nonce = bytes(8) + (1).to_bytes(4, "big")
    assert AESGCM(session_key("s2r")).decrypt(nonce, dg[14:], dg[:14])[4:] == sym
    dg = r.seal(Close(CloseCode.DONE))
    assert AESGCM(session_key("r2s")).decrypt(nonce, dg[14:], dg[:14]) == bytes([0])
    early = early_sender().seal(Source(0, sym))  # pn 1 under K0_s2r = HKDF(psk, R_s, "...s2r-early" + sid)
    k0 = hkdf(R_S, b"pfec/2 s2r-early" + struct.pack(">Q", SID))
    assert AESGCM(k0).decrypt(nonce, early[14:], early[:14])[4:] == sym
    offer = early_sender().seal(Offer(SS, 1, 1, 1, bytes(32), sender_random=R_S))
    k_hs = hkdf(b"pfec/2 handshake", b"pfec/2 hs s2r")
    assert AESGCM(k_hs).decrypt(offer[14:26], offer[26:], offer[:26])[48:64] == R_S


def test_keys_differ_per_session_direction_and_randomness() -> None:
    """Each direction's key changes with its own side's random: a replayed OFFER (same R_s) meets a new
    R_r, so the receiver's K_r2s is new; the sender's K_s2r and K0 change with R_s."""
    keys = {
        session_key(d, sid, r_s, r_r)
        for sid in (0, SID)
        for d in ("s2r", "r2s")
        for r_s in (R_S, bytes(16))
        for r_r in (R_R, bytes(16))
    }
    assert len(keys) == 16
    kr = Keyring(PSK)
    assert kr.derivations == 2  # the two static handshake keys, once
    kr.session(SID, R_S, R_R)
    kr.early(SID, R_S)
    assert kr.derivations == 5
    with pytest.raises(ValueError):
        Keyring(bytes(31))
    with pytest.raises(ValueError):
        kr.session(SID, R_S, bytes(15))
    with pytest.raises(ValueError):
        kr.early(-1, R_S)
    # A receiver that draws a new R_r seals different bytes for the same message and packet number.
    a = pair(r_r=bytes(16))[1].seal(Close(CloseCode.DONE))
    b = pair(r_r=bytes([1]) * 16)[1].seal(Close(CloseCode.DONE))
    assert a[:14] == b[:14] and a[14:] != b[14:]


def test_handshake_datagrams() -> None:
    kr = keyring_for(PSK, True)
    s = early_sender()
    offer = Offer(SS, 16, 10, 1000, bytes(32), 0, 1, b"app", R_S)
    dg = s.seal(offer)
    header = peek_header(dg)
    assert header.phase is KeyPhase.HANDSHAKE and dg[1] == 0x84
    assert open_handshake(kr, Role.RECEIVER, header, dg) == offer
    assert s.seal(offer)[14:26] != dg[14:26]  # a fresh random nonce per seal
    with pytest.raises(AuthError):  # another PSK's static key
        open_handshake(Keyring(OTHER_PSK), Role.RECEIVER, header, dg)
    accept = seal_handshake(kr, Role.RECEIVER, Accept(16, 10, R_R), SID, 1, bytes(12), R_S)
    hdr, msg = s.open(accept)
    assert msg == Accept(16, 10, R_R) and hdr.phase is KeyPhase.HANDSHAKE
    other = PacketProtector(kr, SID, Role.SENDER, SS, local_random=bytes(16))
    with pytest.raises(AuthError):  # R_s is the ACCEPT's associated data: another attempt's does not open
        other.open(accept)
    with pytest.raises(ReplayError):
        s.open(accept)
    with pytest.raises(ParseError) as ei:  # the sender holds no session key before the ACCEPT's R_r
        s.open(forge(encode_body(Close(CloseCode.DONE)), 8, direction="r2s"))
    assert ei.value.reason == "no_key"
    with pytest.raises(ValueError):  # a sender never seals an ACCEPT
        seal_handshake(kr, Role.SENDER, Accept(16, 10, R_R), SID, 1, bytes(12), R_S)
    with pytest.raises(ValueError):
        seal_handshake(kr, Role.RECEIVER, Accept(16, 10, R_R), SID, 1, bytes(11), R_S)
    s.set_peer_random(R_R)
    assert s.has_session_keys and peek_header(s.seal(Source(0, bytes(SS)))).phase is KeyPhase.SESSION
    with pytest.raises(ValueError):
        s.set_peer_random(R_R)


def test_session_rewrite_and_foreign_key_fail_auth() -> None:
    s1, _ = pair(sid=1)
    _, r2 = pair(sid=2)
    dg = bytearray(s1.seal(Source(0, bytes(SS))))
    dg[2:10] = (2).to_bytes(8, "big")  # claim session 2: key differs, so the tag fails
    with pytest.raises(AuthError):
        r2.open(bytes(dg))
    foreign = pair(psk=OTHER_PSK)[0]
    _, r = pair()
    with pytest.raises(AuthError) as ei:
        r.open(foreign.seal(Source(0, bytes(SS))))
    assert ei.value.reason == "auth"


def test_own_direction_reflection_rejected() -> None:
    s, r = pair()
    other_sender = pair()[0]
    with pytest.raises(ParseError) as ei:
        other_sender.open(s.seal(Source(0, bytes(SS))))  # sender never receives SOURCE
    assert ei.value.reason == "bad_type"
    # CLOSE is legal both ways, but a reflected one uses the wrong direction key.
    with pytest.raises(AuthError):
        other_sender.open(s.seal(Close(CloseCode.DONE)))
    with pytest.raises(AuthError):
        s.open(forge(encode_body(Close(CloseCode.DONE)), MsgType.CLOSE, direction="s2r"))
    assert isinstance(s.open(forge(encode_body(Close(CloseCode.DONE)), 8, direction="r2s"))[1], Close)
    assert isinstance(r.open(forge(encode_body(Close(CloseCode.DONE)), 8, direction="s2r"))[1], Close)


def test_wrong_session_rejected_before_auth() -> None:
    s, _ = pair(sid=7)
    _, r = pair(sid=8)
    with pytest.raises(ParseError) as ei:
        r.open(s.seal(Source(0, bytes(SS))))
    assert ei.value.reason == "wrong_session" and type(ei.value) is ParseError


# --------------------------------------------------------------------------- hostile input


def assert_parse_error(rx: PacketProtector, dg: bytes | bytearray | memoryview) -> ParseError:
    with pytest.raises(ParseError) as ei:
        rx.open(dg)
    assert ei.value.reason in PARSE_REASONS
    return ei.value


@pytest.mark.parametrize("auth", [True, False])
def test_every_truncation_rejected(auth: bool) -> None:
    for msg in sample_messages():
        s, r = pair(auth=auth)
        tx, rx = (s, r) if sender_of(msg) is Role.SENDER else (r, s)
        dg = tx.seal(msg)
        for cut in range(len(dg)):
            err = assert_parse_error(rx, dg[:cut])
            if cut < HEADER_SIZE + TAG_SIZE:
                assert err.reason == "truncated"
            with pytest.raises(ParseError):
                peek_header(dg[:cut]) if cut < 30 else rx.open(memoryview(dg)[:cut])
        assert rx.open(dg)[1] == msg  # no state was spent by the failures


@pytest.mark.parametrize("auth", [True, False])
def test_oversized_and_padded_rejected(auth: bool) -> None:
    for msg in sample_messages():
        s, r = pair(auth=auth)
        tx, rx = (s, r) if sender_of(msg) is Role.SENDER else (r, s)
        dg = tx.seal(msg)
        if auth or msg.TYPE in (MsgType.SOURCE, MsgType.REPAIR, MsgType.ACK, MsgType.ACCEPT):
            # (unauthenticated variable-length bodies just grow by a byte: nothing to detect)
            err = assert_parse_error(rx, dg + b"\0")
            assert err.reason in {"bad_length", "auth", "oversized"}
        err = assert_parse_error(rx, dg + b"\0" * (MAX_DATAGRAM + 1 - len(dg)))
        assert err.reason == "oversized"
        assert rx.open(dg)[1] == msg
    with pytest.raises(ParseError) as ei:
        peek_header(bytes(MAX_DATAGRAM + 1))
    assert ei.value.reason == "oversized"


@pytest.mark.parametrize("kind", [0, 2, 3, 4, 7])
def test_every_bit_flip_detected(kind: int) -> None:
    msg = sample_messages()[kind]
    s, r = pair()
    tx, rx = (s, r) if sender_of(msg) is Role.SENDER else (r, s)
    dg = tx.seal(msg)
    for pos in range(len(dg)):
        for mask in (0x01, 0x80):
            bad = bytearray(dg)
            bad[pos] ^= mask
            assert_parse_error(rx, bytes(bad))
    assert rx.open(dg)[1] == msg


def test_header_field_errors() -> None:
    s, r = pair()
    dg = s.seal(Source(0, bytes(SS)))
    for pos, value, reason in [
        (0, 1, "bad_version"),
        (0, 2, "bad_version"),  # version 2: the OFFER before its span field
        (0, WIRE_VERSION + 1, "bad_version"),
        (0, 0, "bad_version"),
        (1, 0, "bad_type"),
        (1, 10, "bad_type"),
        (1, 0x49, "bad_type"),  # DONE travels under the session keys only, never early
        (1, 3, "bad_type"),  # ACK never travels sender -> receiver
        (1, 0xC1, "bad_type"),  # phase bits 11: no such phase
        (1, 0x85, "bad_type"),  # a handshake ACCEPT never travels sender -> receiver
        (1, 0x41, "auth"),  # the early phase: another key
        (1, 4, "bad_length"),  # an OFFER body is at most 1358 B
        (1, 2, "truncated"),  # a REPAIR needs 4 more bytes
    ]:
        bad = bytearray(dg)
        bad[pos] = value
        assert assert_parse_error(r, bytes(bad)).reason == reason
    bad = bytearray(dg)
    bad[10:14] = bytes(4)
    assert assert_parse_error(r, bytes(bad)).reason == "bad_field"
    with pytest.raises(ParseError):
        peek_header(bytes(bad))
    newer = bytes([WIRE_VERSION + 1]) + dg[1:]
    for b in (newer, dg[:1] + bytes([77]) + dg[2:], dg[:1] + bytes([0xC1]) + dg[2:]):
        with pytest.raises(ParseError):
            peek_header(b)


def test_body_field_errors_after_auth() -> None:
    _, r = pair()
    s, _ = pair()
    sym = bytes(SS)
    cases = [
        (MsgType.REPAIR, struct.pack(">HHI", 1, 0x5000, 9) + sym, "s2r"),  # NSS 0
        (MsgType.CLOSE, bytes([9]) + b"x", "s2r"),  # unknown close code
        (MsgType.CLOSE, bytes([0]) + b"\xff\xfe", "s2r"),  # invalid UTF-8
        (MsgType.CLOSE, bytes([0]) + b"x" * 513, "s2r"),  # text too long
        (MsgType.OFFER, struct.pack(">HHII32sHH16s", SS, 1, 1, 1, bytes(32), 3, 3, R_S), "s2r"),
        (MsgType.OFFER, struct.pack(">HHII32sHH16s", SS, 1, 1, 1, bytes(32), 0, 0, R_S), "s2r"),
        (MsgType.OFFER, struct.pack(">HHII32sHH16s", 0, 1, 1, 1, bytes(32), 0, 1, R_S), "s2r"),
        (MsgType.OFFER, struct.pack(">HHII32sHH16s", SS + 1, 1, 1, 1, bytes(32), 0, 1, R_S), "s2r"),
        (MsgType.REFUSE, bytes([0]) + b"x", "r2s"),
        (MsgType.REFUSE, bytes([6]), "r2s"),
        (MsgType.REFUSE, bytes([1]) + b"\xc3", "r2s"),
        (MsgType.RESULT, struct.pack(">IHH", 1, 1, 1), "r2s"),
        (MsgType.ACK, b"\0" * 35, "r2s"),
        (MsgType.ACK, struct.pack(">IIIHHIIIIIH", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9) + b"\0", "r2s"),
    ]
    for pn, (mtype, body, direction) in enumerate(cases, start=1):
        rx = r if direction == "s2r" else s
        err = assert_parse_error(rx, forge(body, mtype, pn=pn, direction=direction))
        assert err.reason in {"bad_field", "bad_length", "truncated"}, (mtype, err.reason)
        # authentic but out of its domain: the key holder's bug, told apart from junk
        assert isinstance(err, MalformedError) or err.reason in {"truncated", "bad_length"}, (mtype, err)
        with pytest.raises(ParseError):
            decode_body(mtype, body, SS)
    with pytest.raises(ParseError) as ei:
        decode_body(0, b"", SS)
    assert ei.value.reason == "bad_type"


def test_unauthenticated_mode_checks_tag_and_format() -> None:
    s, r = pair(auth=False)
    dg = s.seal(Source(3, b"z" * SS))
    assert dg[-TAG_SIZE:] == bytes(TAG_SIZE) and dg[HEADER_SIZE + 4 : -TAG_SIZE] == b"z" * SS
    bad = bytearray(dg)
    bad[-1] = 1
    assert isinstance(assert_parse_error(r, bytes(bad)), AuthError)
    assert assert_parse_error(r, dg[:-1]).reason == "truncated"
    # same datagram sizes as the authenticated mode
    for msg in sample_messages():
        assert len(seal_open(msg, auth=False)[0]) == len(seal_open(msg, auth=True)[0])
    # an authenticated datagram is rejected by an unauthenticated receiver and vice versa
    sa, ra = pair(auth=True)
    assert_parse_error(r, sa.seal(Source(0, bytes(SS))))
    assert_parse_error(ra, dg)


# --------------------------------------------------------------------------- replay


@pytest.mark.parametrize("auth", [True, False])
def test_duplicate_and_reordered(auth: bool) -> None:
    s, r = pair(auth=auth)
    dgs = [s.seal(Source(i, bytes(SS))) for i in range(300)]
    order = list(range(300))
    random.Random(1).shuffle(order)
    for i in order:
        hdr, msg = r.open(dgs[i])
        assert hdr.packet_number == i + 1 and isinstance(msg, Source) and msg.esi == i
    for i in (0, 150, 299):
        with pytest.raises(ReplayError) as ei:
            r.open(dgs[i])
        assert ei.value.reason == "replay" and isinstance(ei.value, ParseError)
    assert r.largest_received_pn == 300


def test_too_old_boundary() -> None:
    s, r = pair(window=1024)
    dgs = [s.seal(Source(i, bytes(SS))) for i in range(1100)]
    r.open(dgs[0])
    r.open(dgs[1099])  # pn 1100
    r.open(dgs[1100 - 1023 - 1])  # pn 77: exactly 1023 behind, still inside
    with pytest.raises(ReplayError) as ei:
        r.open(dgs[1100 - 1024 - 1])  # pn 76: 1024 behind
    assert ei.value.reason == "too_old"
    with pytest.raises(ReplayError):
        r.open(dgs[0])
    with pytest.raises(ReplayError) as ei:
        r.open(dgs[76])  # pn 77 again
    assert ei.value.reason == "replay"


def test_failed_auth_does_not_touch_window() -> None:
    s, r = pair()
    dgs = [s.seal(Source(i, bytes(SS))) for i in range(3)]
    forged = bytearray(dgs[2])
    forged[-1] ^= 1
    assert_parse_error(r, bytes(forged))
    assert r.largest_received_pn == 0
    for d in dgs:
        r.open(d)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 16), st.lists(st.integers(1, 80), max_size=120))
def test_replay_window_matches_reference(window: int, deliveries: list[int]) -> None:
    s, r = pair(16, auth=False, window=window)
    dgs = [s.seal(Source(i, bytes(16))) for i in range(80)]
    seen: set[int] = set()
    largest = 0
    for pn in deliveries:
        if pn <= largest - window:
            expect: str | None = "too_old"
        elif pn in seen:
            expect = "replay"
        else:
            expect = None
        if expect is None:
            r.open(dgs[pn - 1])
            seen.add(pn)
            largest = max(largest, pn)
        else:
            with pytest.raises(ReplayError) as ei:
                r.open(dgs[pn - 1])
            assert ei.value.reason == expect
        assert r.largest_received_pn == largest


# --------------------------------------------------------------------------- fuzz


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=1500), st.booleans())
def test_random_bytes_only_parse_error(data: bytes, auth: bool) -> None:
    for p in (*pair(64, auth=auth), early_sender(64, auth=auth)):
        try:
            p.open(data)
        except ParseError as e:
            assert e.reason in PARSE_REASONS
        try:
            peek_header(data)
        except ParseError as e:
            assert e.reason in PARSE_REASONS


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 8), st.binary(max_size=1400 - 30), st.integers(0, 3), st.booleans())
def test_random_bodies_behind_valid_header(mtype: int, body: bytes, pn: int, zero_tag: bool) -> None:
    """Get past the header checks; unauthenticated receivers then parse random bodies."""
    for phase in (0x00, 0x40, 0x80):
        header = struct.pack(">BBQI", WIRE_VERSION, mtype | phase, SID, pn)
        dg = header + body + (bytes(16) if zero_tag else b"\x01" * 16)
        for auth in (True, False):
            for p in (*pair(64, auth=auth), early_sender(64, auth=auth)):
                try:
                    p.open(dg)
                except ParseError as e:
                    assert e.reason in PARSE_REASONS
        try:
            decode_body(mtype, body, 64)
        except ParseError as e:
            assert e.reason in PARSE_REASONS


# --------------------------------------------------------------------------- hygiene


def test_sans_io_imports() -> None:
    names: set[str] = set()
    modules = (frames, encoding, wire_messages, seal)
    trees = [ast.parse(Path(module.__file__).read_text()) for module in modules]
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"asyncio", "socket", "time", "torch", "pickle", "json"}


def test_exceptions_hierarchy() -> None:
    assert issubclass(AuthError, ParseError) and issubclass(ReplayError, ParseError)
    e = ParseError("truncated", "x")
    assert e.reason == "truncated" and "truncated" in str(e)
