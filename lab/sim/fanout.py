"""Fan-out in simulated time: one context to N receivers over one uplink, each behind its own loss.

The topology is the fan-out relay's (``lab/emulator/fanout.py``): the sender's datagrams cross one uplink
of ``rate_mbps`` once (serialised one at a time), then each receiver's branch: its one-way delay and its
own loss realization. Two ways to carry the same handoff (one ``prepare``, one send queue):

- ``coded``: F's ``GroupSession`` (sender/transport/fanout): every datagram sealed once under the group
  key and sent once, a copy down every branch; each receiver is a real ``ReceiverSession`` fed through its
  ``GroupMembership``, its ACKs sealed under its own keys and opened before the group sees them. The
  member sessions start as an established handshake would leave them: one OFFER-sized datagram per member
  crosses the uplink first (uplink time, counted) and the session opens when it arrives (never lost).
- ``unicast``: N real ``SenderSession``/``ReceiverEndpoint`` pairs (full handshakes), each planned for
  its share of the uplink (``rate / N``) and the same deadline; the uplink serves the ready ones in turn,
  so their pacing adds up to what it carries.

Receiver i meets exactly the losses a solo handoff with seed ``seed + SEED_STRIDE * i`` meets (its data
datagrams indexed as the solo's, its control datagrams on the solo's control stream), so each receiver's
``solo`` (``run_once``, the whole uplink to itself) and ``oracle`` (``run_oracle``) are paired with it;
``group_oracle`` credits every receiver the sources the worst one's oracle delivers (a group that serves
each receiver whole can send no more).
The reverse path is lossless (as ``pfec sim``'s default). Recovered utility per receiver is scored at its
deadline as the solo's (``Handoff.credit``), after checking the decoded symbols byte for byte.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pfec.common.plan.deadline import repair_cap, resolve_window_cap
from pfec.common.sched.policies import get_scheme
from pfec.common.wire.group import GroupTicket, group_sealer
from pfec.common.wire.keyring import keyring_for
from pfec.common.wire.messages import (
    HEADER_SIZE,
    NONCE_SIZE,
    OFFER_FIXED_SIZE,
    TAG_SIZE,
    TYPE_MASK,
    Ack,
    Offer,
    Role,
)
from pfec.common.wire.seal import PacketProtector
from pfec.lab.reporting.stats import mean_ci95_fields
from pfec.lab.sim.channel import LossModel, realization_rng
from pfec.lab.sim.handoff import Handoff, SimConfig, prepare
from pfec.lab.sim.simulate import (
    SIM_FINGERPRINT,
    SIM_PSK,
    forward_losses,
    run_once,
    run_oracle,
    seeded_random_bytes,
)
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.fanout.member import GroupMembership
from pfec.receiver.handshake import grant_span
from pfec.receiver.session import DeadlineReached, ReceiverConfig, ReceiverSession
from pfec.sender.transport.fanout.group import GroupConfig, GroupSession
from pfec.sender.transport.repair_plan import warm_up
from pfec.sender.transport.session import SenderSession
from pfec.sender.transport.transfer import (
    LinkBudget,
    SenderSetup,
    SendQueue,
    assemble_sender,
    decoder_span_for,
)

__all__ = ["FANOUTS", "MAX_RECEIVERS", "SEED_STRIDE", "FanoutConfig", "receiver_config", "simulate_fanout"]

FANOUTS = ("coded", "unicast")
MAX_RECEIVERS = 8
SEED_STRIDE = 7919  # receiver i's loss streams are a solo handoff's with seed + SEED_STRIDE * i
_DATA_TYPES = (1, 2)  # SOURCE, REPAIR
_OFFER_BYTES = HEADER_SIZE + NONCE_SIZE + OFFER_FIXED_SIZE + TAG_SIZE


@dataclass(frozen=True)
class FanoutConfig:
    """``base``: the handoff and the link (its ``loss`` unused); ``losses``: one per receiver."""

    base: SimConfig
    losses: tuple[LossModel, ...]
    scheme: str = "heuristic"

    def __post_init__(self) -> None:
        if not 1 <= len(self.losses) <= MAX_RECEIVERS:
            raise ValueError(f"receivers must be 1..{MAX_RECEIVERS}, got {len(self.losses)}")
        if self.base.mode != "handoff" or self.base.bottlenecked:
            raise ValueError("fan-out is simulated for a whole-cache handoff on a fixed-rate link")
        get_scheme(self.scheme)


def receiver_config(config: FanoutConfig, i: int) -> SimConfig:
    """Receiver i's solo handoff: the base with its loss and its seed (its own loss streams)."""
    return dataclasses.replace(config.base, loss=config.losses[i], seed=config.base.seed + SEED_STRIDE * i)


class _Branch:
    """Receiver i's path after the uplink: delay, the solo's data and control loss realizations."""

    def __init__(self, handoff: Handoff, realization: int) -> None:
        cfg = handoff.config
        self.owd_s = cfg.owd_s
        self.data = forward_losses(handoff, realization)
        self.ctl = cfg.loss.realize(64, handoff.slot_s, realization_rng(cfg.seed, realization, "control"))
        self.k_data = self.k_ctl = 0

    def arrives(self, datagram: bytes, left_uplink: float) -> float | None:
        if datagram[1] & TYPE_MASK in _DATA_TYPES:
            lost, self.k_data = bool(self.data[self.k_data % len(self.data)]), self.k_data + 1
        else:
            lost, self.k_ctl = bool(self.ctl[self.k_ctl % len(self.ctl)]), self.k_ctl + 1
        return None if lost else left_uplink + self.owd_s


@dataclass
class _Outcome:
    utility: list[float]
    start_s: list[float]
    uplink_datagrams: int
    uplink_bytes: int
    repairs: int
    dropped: list[str]
    sent: list[int] | None = None  # solo: each receiver's handoff's datagrams


class _Engine:
    """The shared uplink and the per-receiver branches in simulated time (cf. ``engine.SimRun``)."""

    def __init__(self, handoffs: Sequence[Handoff], realization: int, rate_bps: float) -> None:
        self.branches = [_Branch(h, realization) for h in handoffs]
        self.rate_bps = rate_bps
        self.free_at = 0.0
        self.heap: list[tuple[float, int, int, bool, bytes]] = []  # (time, seq, receiver, to_sender, data)
        self.seq = 0
        self.datagrams = self.bytes = 0

    def uplink(self, datagram: bytes, now: float, targets: Sequence[int]) -> None:
        """Serialise once on the uplink, then a copy down each target's branch."""
        self.free_at = max(now, self.free_at) + len(datagram) * 8 / self.rate_bps
        self.datagrams += 1
        self.bytes += len(datagram)
        for i in targets:
            at = self.branches[i].arrives(datagram, self.free_at)
            if at is not None:
                self.push(at, i, False, datagram)

    def back(self, i: int, datagram: bytes, now: float) -> None:
        self.push(now + self.branches[i].owd_s, i, True, datagram)

    def push(self, at: float, i: int, to_sender: bool, datagram: bytes) -> None:
        heapq.heappush(self.heap, (at, self.seq, i, to_sender, datagram))
        self.seq += 1


def _score(handoff: Handoff, send: SendQueue, order: str, event: DeadlineReached) -> tuple[float, float]:
    """(recovered utility, start time) at a receiver's deadline, its decoded symbols checked."""
    decoded = event.decoded_esis
    if not np.array_equal(event.store[decoded], send.symbols[decoded]):
        raise AssertionError("decoder output differs from the source symbols")
    _complete, utility, _plain = handoff.credit(order, decoded)
    return utility, event.started_at


def _member_keys(i: int, seed: int, realization: int, authenticate: bool, symbol: int
                 ) -> tuple[int, PacketProtector, PacketProtector, bytes]:
    """(session id, the member's protector, the sender's for it, R_s) as its handshake would leave them."""
    rnd = seeded_random_bytes(seed, realization, f"member-{i}")
    sid = ((seed << 32 | realization) + 1 + i) & 0xFFFFFFFFFFFFFFFF
    r_s, r_r = rnd(16), rnd(16)
    keyring = keyring_for(SIM_PSK, authenticate)
    rx = PacketProtector(keyring, sid, Role.RECEIVER, symbol, local_random=r_r, peer_random=r_s)
    tx = PacketProtector(keyring, sid, Role.SENDER, symbol, local_random=r_s, peer_random=r_r)
    return sid, rx, tx, r_s


def _run_coded(config: FanoutConfig, handoffs: Sequence[Handoff], realization: int) -> _Outcome:
    base = handoffs[0]
    cfg, order = base.config, get_scheme(config.scheme).order
    send = base.send_queue(order)
    n, symbol = len(handoffs), base.plan.symbol_size
    budget = base.budget
    window = resolve_window_cap(cfg.window_cap, budget.owd_s, budget.slot_s)
    span = decoder_span_for(budget, window, send.n_source)
    ticket = GroupTicket.fresh(0xFA000000 + realization, seeded_random_bytes(cfg.seed, realization, "group"))
    member_cfg = ReceiverConfig(ack_every=cfg.ack_every)
    # Each member's span as its endpoint would grant the OFFER's request (what its ACCEPT would say).
    span_offer = Offer(symbol, window, send.n_source, int(budget.deadline_s * 1e6), SIM_FINGERPRINT,
                       span=span)
    granted = grant_span(span_offer, member_cfg)
    member_cfg = dataclasses.replace(member_cfg, decoder_span=granted)
    group = GroupSession(group_sealer(ticket, symbol), send.symbols, GroupConfig(
        budget_s=budget.deadline_s, owd_s=max(h.config.owd_s for h in handoffs),
        repair_budget=repair_cap(cfg.repair_budget, send.n_source, budget.deadline_s, budget.slot_s),
        window_cap=min(window, 4095), span=granted), [f"r{i}" for i in range(n)])
    engine = _Engine(handoffs, realization, cfg.rate_bps)
    keys = [_member_keys(i, cfg.seed, realization, cfg.authenticate, symbol) for i in range(n)]
    members: list[GroupMembership | None] = [None] * n
    utility, start = [0.0] * n, [math.nan] * n
    done = [False] * n
    now = 0.0
    group.start(now)
    for i in range(n):  # each member's handshake: one OFFER-sized datagram on the uplink, to it alone
        engine.free_at += _OFFER_BYTES * 8 / cfg.rate_bps
        engine.datagrams += 1
        engine.bytes += _OFFER_BYTES
        engine.push(engine.free_at + handoffs[i].config.owd_s, i, False, b"")
    ready = True
    while True:
        if ready and now >= engine.free_at:
            datagram = group.next_datagram(now)
            if datagram is not None:
                engine.uplink(datagram, now, range(n))
                continue
            ready = False
        at = engine.free_at if ready else math.inf
        if engine.heap:
            at = min(at, engine.heap[0][0])
        timers = [group.get_timer()] + [m.session.get_timer() for m, d in zip(members, done, strict=True)
                                        if m is not None and not d]
        at = min([at, *(t for t in timers if t is not None)])
        if at == math.inf:
            break
        now = max(now, at)
        while engine.heap and engine.heap[0][0] <= now:
            _t, _s, i, to_sender, datagram = heapq.heappop(engine.heap)
            if to_sender:
                _h, msg = keys[i][2].open(datagram)
                if isinstance(msg, Ack):
                    group.on_ack(i, msg, now)
                    ready = True
            elif not datagram:  # the OFFER arrives: the member's session opens
                sid, rx, _tx, r_s = keys[i]
                offer = Offer(symbol, window, send.n_source, int((budget.deadline_s - now) * 1e6),
                              SIM_FINGERPRINT, sender_random=r_s, span=span)
                session = ReceiverSession(sid, rx, offer, 1, now, member_cfg)
                members[i] = GroupMembership(ticket, session)
            elif (m := members[i]) is not None and not done[i]:
                m.receive(datagram, now)
        if (t := group.get_timer()) is not None and t <= now:
            group.handle_timer(now)
            ready = True
        for i, m in enumerate(members):
            if m is None or done[i]:
                continue
            if (t := m.session.get_timer()) is not None and t <= now:
                m.session.handle_timer(now)
            while (event := m.session.next_event()) is not None:
                if isinstance(event, DeadlineReached):
                    utility[i], start[i] = _score(base, send, order, event)
                    done[i] = True
            for datagram in m.session.datagrams_to_send():  # the last ACK too: it says "all decoded"
                engine.back(i, datagram, now)
        while group.next_event() is not None:
            pass
        if all(done) and not group.phase.sends:
            break
    dropped = [m.reason for m in group.members if m.reason]
    return _Outcome(utility, start, engine.datagrams, engine.bytes, group.repairs_sent, dropped)


def _run_unicast(config: FanoutConfig, handoffs: Sequence[Handoff], realization: int) -> _Outcome:
    base = handoffs[0]
    cfg, scheme = base.config, get_scheme(config.scheme)
    n = len(handoffs)
    engine = _Engine(handoffs, realization, cfg.rate_bps)
    senders: list[SenderSession] = []
    endpoints: list[ReceiverEndpoint] = []
    for i, h in enumerate(handoffs):
        share = LinkBudget.for_plan(h.plan, cfg.rate_bps / n, h.config.owd_s,
                                    deadline_ms=h.deadline_s * 1000)
        setup = SenderSetup(scheme=scheme, repair_budget=cfg.repair_budget, window_cap=cfg.window_cap,
                            fingerprint=SIM_FINGERPRINT, psk=SIM_PSK, result_wait_s=0.5 + 4 * h.config.owd_s,
                            target_nonzeros=cfg.target_nonzeros, authenticate=cfg.authenticate,
                            random_bytes=seeded_random_bytes(cfg.seed, realization, f"sender-{i}"),
                            loss_prior=h.config.sender_loss_prior)
        sid = ((cfg.seed << 32 | realization) + 1 + i) & 0xFFFFFFFFFFFFFFFF
        senders.append(assemble_sender(sid, base.send_queue(scheme.order), share, setup))
        endpoints.append(ReceiverEndpoint(SIM_PSK, SIM_FINGERPRINT, ReceiverConfig(ack_every=cfg.ack_every),
                                          authenticate=cfg.authenticate,
                                          random_bytes=seeded_random_bytes(cfg.seed, realization,
                                                                           f"receiver-{i}")))
    send = base.send_queue(scheme.order)
    utility, start = [0.0] * n, [math.nan] * n
    ready = [True] * n
    turn = 0
    now = 0.0
    for s in senders:
        s.start(now)
    while True:
        if any(ready) and now >= engine.free_at:
            for k in range(n):  # round robin over the sessions with something to send
                i = (turn + k) % n
                if ready[i] and (datagram := senders[i].next_datagram(now)) is not None:
                    engine.uplink(datagram, now, (i,))
                    turn = i + 1
                    break
                ready[i] = False
            continue
        at = engine.free_at if any(ready) else math.inf
        if engine.heap:
            at = min(at, engine.heap[0][0])
        for t in [*(s.get_timer() for s in senders), *(e.get_timer() for e in endpoints)]:
            if t is not None and t < at:
                at = t
        if at == math.inf:
            break
        now = max(now, at)
        while engine.heap and engine.heap[0][0] <= now:
            _t, _s, i, to_sender, datagram = heapq.heappop(engine.heap)
            if to_sender:
                senders[i].receive_datagram(datagram, now)
                ready[i] = True
            else:
                endpoints[i].receive_datagram(datagram, now)
        for i in range(n):
            if (t := senders[i].get_timer()) is not None and t <= now:
                senders[i].handle_timer(now)
                ready[i] = True
            if (t := endpoints[i].get_timer()) is not None and t <= now:
                endpoints[i].handle_timer(now)
            while (event := endpoints[i].next_event()) is not None:
                if isinstance(event, DeadlineReached):
                    utility[i], start[i] = _score(base, send, scheme.order, event)
                    endpoints[i].sessions[event.session_id].send_result(b"{}", now)
            for _sid, datagram in endpoints[i].datagrams_to_send():
                engine.back(i, datagram, now)
            while senders[i].next_event() is not None:
                pass
    repairs = sum(s.datagrams_sent["repair"] for s in senders)
    return _Outcome(utility, start, engine.datagrams, engine.bytes, repairs, [])


def simulate_fanout(config: FanoutConfig, fanouts: Sequence[str], realizations: int,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Each fan-out scheme, each receiver's solo handoff and its oracle, on the same realizations."""
    for name in fanouts:
        if name not in FANOUTS:
            raise ValueError(f"unknown fan-out {name!r}; choose from {', '.join(FANOUTS)}")
    if realizations < 1:
        raise ValueError(f"realizations must be >= 1, got {realizations!r}")
    warm_up()
    n = len(config.losses)
    handoffs = [prepare(receiver_config(config, i)) for i in range(n)]
    runs: dict[str, list[_Outcome]] = {name: [] for name in (*dict.fromkeys(fanouts), "solo", "oracle")}
    total, step = realizations * len(runs), 0
    group_oracle: list[_Outcome] = []
    scheme = get_scheme(config.scheme)
    for r in range(realizations):
        for name in runs:
            if name == "coded":
                runs[name].append(_run_coded(config, handoffs, r))
            elif name == "unicast":
                runs[name].append(_run_unicast(config, handoffs, r))
            else:
                each = [run_once(h, scheme, r) if name == "solo" else run_oracle(h, r) for h in handoffs]
                sent = [x.source_sent + x.repair_sent + x.control_sent for x in each]
                runs[name].append(_Outcome([x.recovered_utility for x in each],
                                           [x.start_s if x.start_s is not None else math.nan for x in each],
                                           round(float(np.mean(sent))), 0,
                                           round(float(np.mean([x.repair_sent for x in each]))), [], sent))
                if name == "oracle":
                    group_oracle.append(_group_oracle(handoffs, each))
            step += 1
            if progress is not None:
                progress(step, total)
    runs["group_oracle"] = group_oracle
    return _report(config, handoffs[0], runs)


def _group_oracle(handoffs: Sequence[Handoff], oracles: Sequence[Any]) -> _Outcome:
    """The idealised group: one stream that every receiver decodes whole, so its sources are those the
    worst receiver's arriving slots carry (its oracle's, an ideal code's repairs filling the rest); each
    receiver is credited that utility-ordered prefix."""
    k = min(x.decoded_symbols for x in oracles)
    utility = [h.credit("utility", np.arange(k))[1] for h in handoffs]
    return _Outcome(utility, [math.nan] * len(handoffs), 0, 0, 0, [])


def _report(config: FanoutConfig, handoff: Handoff, runs: dict[str, list[_Outcome]]) -> dict[str, Any]:
    cfg, n = config.base, len(config.losses)
    oracle = runs["oracle"]
    out: dict[str, Any] = {"inputs": {
        "receivers": n, "losses": [repr(x) for x in config.losses], "scheme": config.scheme,
        "rate_mbps": cfg.rate_mbps, "rtt_ms": cfg.rtt_ms, "rho": round(handoff.rho, 6),
        "deadline_ms": round(handoff.deadline_s * 1000, 3), "tokens": cfg.tokens,
        "n_source": handoff.plan.n_fragments, "repair_budget": cfg.repair_budget, "seed": cfg.seed,
        "seed_stride": SEED_STRIDE, "realizations": len(oracle),
        "notes": {"solo": "each receiver alone on the whole uplink (pfec sim's session, same losses); "
                  "uplink_datagrams_mean is one solo handoff's, the mean over the receivers",
                  "oracle": "each receiver's clairvoyant bound alone on the whole uplink",
                  "group_oracle": "one stream every receiver decodes whole: the sources the worst receiver's "
                  "oracle delivers, credited to each (the bound for a group sized for its worst)"},
    }, "schemes": {}}
    for name, results in runs.items():
        receivers = []
        for i in range(n):
            utils = [o.utility[i] for o in results]
            eff = [u / b.utility[i] if b.utility[i] > 0 else 1.0 for u, b in zip(utils, oracle, strict=True)]
            starts = [o.start_s[i] * 1000 for o in results if not math.isnan(o.start_s[i])]
            receivers.append({"loss": repr(config.losses[i]), **mean_ci95_fields("recovered_utility", utils),
                              **mean_ci95_fields("efficiency", eff),
                              "start_ms_mean": float(np.mean(starts)) if starts else None})
            if name == "solo":
                sent = [o.sent[i] for o in results if o.sent]
                receivers[-1]["uplink_datagrams_mean"] = float(np.mean(sent))
        row: dict[str, Any] = {"receivers": receivers}
        if name not in ("oracle", "group_oracle"):
            row["uplink_datagrams_mean"] = float(np.mean([o.uplink_datagrams for o in results]))
            row["repair_sent_mean"] = float(np.mean([o.repairs for o in results]))
        if name in FANOUTS:
            row["uplink_bytes_mean"] = float(np.mean([o.uplink_bytes for o in results]))
            row["members_dropped"] = sum(len(o.dropped) for o in results)
            row["drop_reasons"] = sorted({d for o in results for d in o.dropped})
        out["schemes"][name] = row
    return out
