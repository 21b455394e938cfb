"""The coding window cap sized from the path (common/plan/deadline.py ``auto_window_cap``), and a handoff
that is configured "auto" coding over that window on both ends."""

from __future__ import annotations

import numpy as np
import pytest

from pfec.common.node.config_models import SenderFecConfig
from pfec.common.plan.deadline import (
    AUTO_WINDOW,
    MAX_AUTO_WINDOW,
    MIN_AUTO_WINDOW,
    auto_window_cap,
    resolve_window_cap,
    slot_seconds,
)
from pfec.common.sched.policies import get_scheme
from pfec.lab.sim.channel import Bernoulli
from pfec.lab.sim.engine import DeadlineScore, SimRun
from pfec.lab.sim.handoff import SimConfig, prepare
from pfec.lab.sim.simulate import SIM_FINGERPRINT, SIM_PSK, _links, seeded_random_bytes
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, ReceiverConfig, ReceiverStats
from pfec.sender.transport.transfer import SenderSetup, assemble_sender

SLOT_100M = slot_seconds(1234, 100e6)  # a 1234-byte symbol at 100 Mbit/s: about 0.1 ms


def test_window_grows_with_rtt_and_rate_within_its_bounds() -> None:
    rtts_ms = [0, 1, 5, 20, 26, 40, 50, 60, 100, 200, 400, 2000]
    by_rtt = [auto_window_cap(r / 2000, SLOT_100M) for r in rtts_ms]
    assert by_rtt == sorted(by_rtt)
    assert by_rtt[0] == by_rtt[3] == MIN_AUTO_WINDOW  # short paths keep the codec's default window
    assert by_rtt[-1] == MAX_AUTO_WINDOW and max(by_rtt) == MAX_AUTO_WINDOW
    assert len(set(by_rtt)) >= 3
    rates = [1e6, 10e6, 50e6, 100e6, 400e6, 1e9, 10e9]
    by_rate = [auto_window_cap(0.05, slot_seconds(1234, r)) for r in rates]
    assert by_rate == sorted(by_rate) and by_rate[0] == MIN_AUTO_WINDOW and by_rate[-1] == MAX_AUTO_WINDOW
    for k in by_rtt + by_rate:
        assert k & (k - 1) == 0  # a power of two


def test_window_is_a_quarter_of_the_bandwidth_delay_product() -> None:
    # 100 ms RTT at 100 Mbit/s: ~980 datagrams in flight -> 245 -> 256; 50 ms: ~490 -> 123 -> 128.
    assert auto_window_cap(0.050, SLOT_100M) == 256
    assert auto_window_cap(0.025, SLOT_100M) == 128
    assert auto_window_cap(0.010, SLOT_100M) == 64  # the main cell (20 ms RTT): unchanged


@pytest.mark.parametrize("owd, slot", [(-0.001, SLOT_100M), (float("nan"), SLOT_100M),
                                       (float("inf"), SLOT_100M), (0.01, 0.0), (0.01, -1.0),
                                       (0.01, float("nan"))])
def test_bad_paths_are_refused(owd: float, slot: float) -> None:
    with pytest.raises(ValueError, match=r"delay|slot"):
        auto_window_cap(owd, slot)


def test_an_explicit_window_cap_overrides_the_path_and_bad_caps_are_refused() -> None:
    auto = auto_window_cap(0.1, SLOT_100M)
    assert resolve_window_cap(AUTO_WINDOW, 0.1, SLOT_100M) == auto > MIN_AUTO_WINDOW
    assert resolve_window_cap(64, 0.1, SLOT_100M) == 64
    assert resolve_window_cap(1000, 0.001, SLOT_100M) == 1000
    for bad in (-1, 4096, 1 << 20):
        with pytest.raises(ValueError, match="window_cap"):
            resolve_window_cap(bad, 0.01, SLOT_100M)
        with pytest.raises(ValueError, match="window_cap"):
            SimConfig(loss=Bernoulli(0.0), window_cap=bad)
    assert SenderFecConfig().window_cap == AUTO_WINDOW
    with pytest.raises(ValueError):
        SenderFecConfig(window_cap=-1)
    with pytest.raises(ValueError):
        SenderFecConfig(window_cap=4096)


def _run(rtt_ms: float, window_cap: int) -> tuple[int, int, int, list[tuple[int, int]], int]:
    """A simulated lossy handoff of the shipped sessions: (the sender's window cap, the receiver session's
    decoder span, the span the sender asked for, the windows of the repairs sent, the first source of the
    open-loop tail)."""
    handoff = prepare(SimConfig(loss=Bernoulli(0.05), rtt_ms=rtt_ms, tokens=192, rho=1.0,
                                window_cap=window_cap))
    send = handoff.send_queue("utility")
    setup = SenderSetup(scheme=get_scheme("heuristic"), repair_budget=0.15, window_cap=window_cap,
                        fingerprint=SIM_FINGERPRINT, psk=SIM_PSK, result_wait_s=0.5, authenticate=False,
                        random_bytes=seeded_random_bytes(1, 0, "sender"))
    sender = assemble_sender(7, send, handoff.budget, setup)
    endpoint = ReceiverEndpoint(SIM_PSK, SIM_FINGERPRINT, ReceiverConfig(), authenticate=False,
                                random_bytes=seeded_random_bytes(1, 0, "receiver"))
    spans: list[int] = []

    def at_deadline(event: DeadlineReached) -> DeadlineScore:
        (session,) = endpoint.sessions.values()
        spans.append(session.decoder.window_cap)
        return DeadlineScore(np.zeros(handoff.plan.n_blocks, dtype=np.bool_), 0.0, 0, 0, 0, ReceiverStats())

    SimRun(sender, endpoint, _links(handoff, 0), at_deadline).drive()
    windows = [(int(a), int(b)) for a, b in sender.inflight.rep_window[: sender.view.repairs_sent]]
    tail_first = sender.send_path.tail_first
    return sender.config.window_cap, spans[0], sender.config.decoder_span, windows, tail_first


def test_a_long_rtt_handoff_codes_over_the_larger_window_on_both_ends() -> None:
    k_long, span_long, asked_long, windows_long, tail_long = _run(200.0, AUTO_WINDOW)
    assert k_long == MAX_AUTO_WINDOW
    assert asked_long >= k_long and span_long >= k_long  # the receiver's decoder holds the window
    assert windows_long and max(end - first for first, end in windows_long) > MIN_AUTO_WINDOW
    # The open-loop tail's code (the whole handoff here: no ACK returns before the send deadline) reaches
    # back to its first source, beyond the window cap, as far as the decoder span granted allows.
    assert tail_long == 0 and max(end - first for first, end in windows_long) > k_long
    assert all(end - first <= span_long for first, end in windows_long)
    # The same path with the cap configured: the override holds for every window, the tail's too.
    k_fixed, _, _, windows_fixed, _ = _run(200.0, MIN_AUTO_WINDOW)
    assert k_fixed == MIN_AUTO_WINDOW
    assert windows_fixed and max(end - first for first, end in windows_fixed) <= MIN_AUTO_WINDOW
    # A short path keeps the default window.
    assert _run(20.0, AUTO_WINDOW)[0] == MIN_AUTO_WINDOW
