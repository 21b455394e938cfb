"""Sender and receiver Prometheus metrics: names, bounded labels, values, promtool lint, HTTP exposition."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pfec.common.codec.fec import FEC_ERROR_REASONS
from pfec.common.wire.messages import PARSE_REASONS, MsgType
from pfec.receiver.metrics import FEC_DROP_REASONS, RECEIVER_DROP_REASONS, ReceiverMetrics
from pfec.sender.metrics import DATAGRAM_TYPES, SENDER_DROP_REASONS, SenderMetrics

ROOT = Path(__file__).resolve().parents[1]
PROMTOOL = shutil.which("promtool")


def populated_sender() -> SenderMetrics:
    m = SenderMetrics()
    m.handoff_started()
    m.handoff_started()
    m.prefill_done(1.7)
    for _ in range(10):
        m.datagram_sent(MsgType.SOURCE, 1400)
    m.datagram_sent("repair", 1400)
    m.datagram_sent("offer", 300)
    m.datagram_received(MsgType.ACK, 80)
    m.dropped("auth")
    m.dropped("replay", 3)
    m.dropped("something new from a peer")
    m.scheduler_decision(3e-6, window_symbols=40, deficit_symbols=2.5)
    m.scheduler_decisions([1_500, 800_000])
    m.handoff_finished("done", 0.42, recovered_utility=0.93)
    m.handoff_finished("refused", 0.01)
    m.precision_bytes_sent("int8", 123_456)
    m.planner_choice("split:int8-int4")
    return m


def populated_receiver() -> ReceiverMetrics:
    m = ReceiverMetrics()
    m.sessions_live(2, 0)
    m.session_refused()
    for _ in range(7):
        m.datagram_received(MsgType.SOURCE, 1400)
    m.datagram_received("repair", 1400)
    m.datagram_sent(MsgType.ACK, 80)
    m.dropped("fec_window_overflow")
    m.drops({"early_overflow": 2, "closed_session": 0, "weird": 1})
    m.symbols_decoded(8)
    m.redundant_repairs(1)
    m.decoder_stall(0.004, count=2)
    assert m.deadline_started(0.0007) is False
    assert m.deadline_started(0.012) is True
    assert m.deadline_started(-0.002) is False  # started early: lateness 0
    m.deadline_slack(0.03)
    m.ttft(0.41)
    m.recovered_utility(0.88)
    m.session_finished("done")
    m.sessions_live(0, 1)  # one ended, a handshake is pending: it is live too
    return m


def test_sender_values() -> None:
    m = populated_sender()
    v = m.registry.get_sample_value
    assert v("pfec_sender_datagrams_sent_total", {"type": "source"}) == 10
    assert v("pfec_sender_datagrams_sent_total", {"type": "repair"}) == 1
    assert v("pfec_sender_repairs_total") == 1
    assert v("pfec_sender_bytes_sent_total") == 11 * 1400 + 300
    assert v("pfec_sender_datagrams_received_total", {"type": "ack"}) == 1
    assert v("pfec_sender_datagrams_dropped_total", {"reason": "replay"}) == 3
    assert v("pfec_sender_datagrams_dropped_total", {"reason": "other"}) == 1
    assert v("pfec_sender_handoffs_total", {"outcome": "done"}) == 1
    assert v("pfec_sender_handoffs_total", {"outcome": "failed"}) == 0  # pre-created at zero
    assert v("pfec_sender_active_handoffs") == 0
    assert v("pfec_sender_window_symbols") == 40 and v("pfec_sender_deficit_symbols") == 2.5
    assert v("pfec_sender_scheduler_decision_seconds_count") == 3
    assert v("pfec_sender_scheduler_decision_seconds_bucket", {"le": "1e-06"}) == 0
    assert v("pfec_sender_scheduler_decision_seconds_bucket", {"le": "2e-06"}) == 1
    assert v("pfec_sender_scheduler_decision_seconds_bucket", {"le": "0.001"}) == 3
    assert v("pfec_sender_recovered_utility_count") == 1
    assert v("pfec_sender_prefill_seconds_sum") == pytest.approx(1.7)
    assert v("pfec_sender_handoff_duration_seconds_count") == 2


def test_receiver_values() -> None:
    m = populated_receiver()
    v = m.registry.get_sample_value
    assert v("pfec_receiver_datagrams_received_total", {"type": "source"}) == 7
    assert v("pfec_receiver_bytes_received_total") == 8 * 1400
    assert v("pfec_receiver_datagrams_dropped_total", {"reason": "fec_window_overflow"}) == 1
    assert v("pfec_receiver_datagrams_dropped_total", {"reason": "early_overflow"}) == 2
    assert v("pfec_receiver_datagrams_dropped_total", {"reason": "other"}) == 1
    assert v("pfec_receiver_decoder_stalls_total") == 2
    assert v("pfec_receiver_decoder_stall_seconds_total") == pytest.approx(0.004)
    assert v("pfec_receiver_deadline_overruns_total") == 1
    assert v("pfec_receiver_deadline_lateness_seconds_count") == 3
    assert v("pfec_receiver_deadline_lateness_seconds_bucket", {"le": "0.0001"}) == 1
    assert v("pfec_receiver_deadline_lateness_seconds_bucket", {"le": "0.001"}) == 2
    assert v("pfec_receiver_deadline_slack_seconds_sum") == pytest.approx(0.03)
    assert v("pfec_receiver_ttft_seconds_count") == 1
    assert v("pfec_receiver_recovered_utility_sum") == pytest.approx(0.88)
    assert v("pfec_receiver_sessions_active") == 1
    assert v("pfec_receiver_sessions_pending") == 1
    assert v("pfec_receiver_sessions_total", {"outcome": "refused"}) == 1
    assert v("pfec_receiver_sessions_total", {"outcome": "done"}) == 1
    assert v("pfec_receiver_decoded_symbols_total") == 8
    assert v("pfec_receiver_repairs_redundant_total") == 1


def test_bad_labels_are_rejected_or_bounded() -> None:
    s, r = SenderMetrics(process_metrics=False), ReceiverMetrics(process_metrics=False)
    with pytest.raises(ValueError, match="unknown datagram type 'bogus'"):
        s.datagram_sent("bogus", 1)
    with pytest.raises(ValueError, match="unknown handoff outcome 'ok'"):
        s.handoff_finished("ok", 1.0)
    with pytest.raises(ValueError, match="unknown session outcome 'refused'"):
        r.session_finished("refused")  # refusals never were active: session_refused()
    with pytest.raises(ValueError, match="overrun_threshold_s must be >= 0"):
        ReceiverMetrics(overrun_threshold_s=-1)
    for i in range(50):  # hostile reasons never create new series
        r.dropped(f"junk{i}")
    reasons = {
        s.labels["reason"]
        for fam in text_string_to_metric_families(r.exposition().decode())
        if fam.name == "pfec_receiver_datagrams_dropped"
        for s in fam.samples
        if s.name.endswith("_total")
    }
    assert reasons == set(RECEIVER_DROP_REASONS)


def test_two_instances_do_not_share_state() -> None:
    a, b = SenderMetrics(), SenderMetrics()
    a.datagram_sent("source", 10)
    assert a.registry.get_sample_value("pfec_sender_bytes_sent_total") == 10
    assert b.registry.get_sample_value("pfec_sender_bytes_sent_total") == 0


def test_drop_reason_sets_cover_the_code() -> None:
    """Every literal reason the sessions drop for is a label value (otherwise it would read 'other')."""
    assert set(FEC_DROP_REASONS) == {f"fec_{r}" for r in FEC_ERROR_REASONS}
    assert set(SENDER_DROP_REASONS) >= PARSE_REASONS and set(RECEIVER_DROP_REASONS) >= PARSE_REASONS
    # A reason is a literal of ``_drop(...)``, or of a dropping input (``_fire(Input.X, now, ...)``).
    pattern = re.compile(r"""(?:_drop\(|_fire\(Input\.[A-Z_]+, now, )\s*["']([a-z_]+)["']""")
    sender_parts = sorted((ROOT / "sender" / "transport").glob("*.py"))
    for srcs, allowed in (
        (sender_parts, SENDER_DROP_REASONS),
        ([ROOT / "receiver" / "session.py"], RECEIVER_DROP_REASONS),
        ([ROOT / "receiver" / "endpoint.py"], RECEIVER_DROP_REASONS),
    ):
        found = {r for src in srcs for r in pattern.findall(src.read_text())}
        assert found, f"no _drop('...') literals found in {srcs}; update this test's pattern"
        assert found <= set(allowed), (
            f"{[s.name for s in srcs]}: reasons {sorted(found - set(allowed))} missing from metrics"
        )


def test_names_follow_conventions() -> None:
    for m, prefix in ((populated_sender(), "pfec_sender_"), (populated_receiver(), "pfec_receiver_")):
        for fam in text_string_to_metric_families(m.exposition().decode()):
            if fam.name.startswith("process_"):
                continue
            assert fam.name.startswith(prefix) or fam.name in m.SHARED, fam.name
            assert fam.documentation, fam.name
            if fam.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
            assert not re.search(r"_(ms|milliseconds|us|kb|mb|bits)(_|$)", fam.name), fam.name
            labels = {k for s in fam.samples for k in s.labels if k != "le"}
            # precision: a KV precision level (int2/int4/int8/native); choice: the break-even planner's
            # mode: the mode a handoff ran in (handoff, split, local)
            assert labels <= {"type", "reason", "outcome", "precision", "choice", "mode"}, (fam.name, labels)
            types = {s.labels["type"] for s in fam.samples if "type" in s.labels}
            assert types <= set(DATAGRAM_TYPES)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus')")
@pytest.mark.parametrize("which", ["sender", "receiver"])
def test_promtool_check_metrics(which: str) -> None:
    m = populated_sender() if which == "sender" else populated_receiver()
    text = m.exposition()
    assert PROMTOOL is not None
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        proc.stdout.decode() + proc.stderr.decode()
    )
    # promtool really lints: a counter without _total is reported.
    bad = b"# HELP x_bytes_sent Bytes.\n# TYPE x_bytes_sent counter\nx_bytes_sent 1\n"
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=bad, capture_output=True, timeout=60)
    assert b"_total" in proc.stdout + proc.stderr


def test_http_serve() -> None:
    aiohttp = pytest.importorskip("aiohttp", reason="aiohttp is a daemon dependency")

    async def main() -> tuple[int, str, bytes]:
        m = populated_receiver()
        runner = await m.serve("127.0.0.1", 0)
        try:
            port = runner.addresses[0][1]
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                return resp.status, resp.headers["Content-Type"], await resp.read()
        finally:
            await runner.cleanup()

    status, ctype, body = asyncio.run(main())
    assert status == 200 and ctype.startswith("text/plain")
    assert b'pfec_receiver_datagrams_received_total{type="source"} 7.0' in body


def test_prefill_speed_and_handoff_modes() -> None:
    """Issue 13: both daemons export their prefill speed under one name; the sender counts handoffs by the
    mode they ran in (pre-created at zero) and refuses an unknown one."""
    from pfec.common.node.lifecycle import measure_node_speed

    for m in (SenderMetrics(process_metrics=False), ReceiverMetrics(process_metrics=False)):
        assert m.registry.get_sample_value("pfec_prefill_tokens_per_second") == 0
        m.prefill_speed(1234.5)
        assert m.registry.get_sample_value("pfec_prefill_tokens_per_second") == 1234.5
        assert asyncio.run(measure_node_speed(None, m)) is None  # no model: 0, not a stale value
        assert m.registry.get_sample_value("pfec_prefill_tokens_per_second") == 0
    s = SenderMetrics(process_metrics=False)
    assert s.registry.get_sample_value("pfec_sender_handoff_modes_total", {"mode": "split"}) == 0
    s.handoff_mode("split")
    assert s.registry.get_sample_value("pfec_sender_handoff_modes_total", {"mode": "split"}) == 1
    with pytest.raises(ValueError):
        s.handoff_mode("both")


def test_torch_threads_are_set_once_and_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13: start-up sets torch's thread counts (default: the usable CPUs) and exports the count; a
    second inter-op setting (torch allows one per process) is tolerated, an out-of-range count refused."""
    import torch

    from pfec.common.model import runtime
    from pfec.common.node.lifecycle import measure_node_speed

    calls: dict[str, list[int]] = {"intra": [], "inter": []}

    def interop(n: int) -> None:
        calls["inter"].append(n)
        if len(calls["inter"]) > 1:
            raise RuntimeError("Error: cannot set number of interop threads after parallel work has started")

    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls["intra"].append(n))
    monkeypatch.setattr(torch, "set_num_interop_threads", interop)
    monkeypatch.setattr(torch, "get_num_threads", lambda: calls["intra"][-1])
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda _pid: {0, 2, 5})
    assert runtime.usable_cpus() == 3
    assert runtime.set_torch_threads(None) == 3
    assert runtime.set_torch_threads(1) == 1  # the second inter-op call raises inside: kept, not fatal
    assert calls == {"intra": [3, 1], "inter": [3, 1]}
    for bad in (0, runtime.MAX_TORCH_THREADS + 1):
        with pytest.raises(ValueError, match="torch threads"):
            runtime.set_torch_threads(bad)
    m = ReceiverMetrics(process_metrics=False)
    assert m.registry.get_sample_value("pfec_torch_threads") == 0
    m.torch_threads(4)
    assert m.registry.get_sample_value("pfec_torch_threads") == 4
    assert asyncio.run(measure_node_speed(None, m)) is None  # no model: 0
    assert m.registry.get_sample_value("pfec_torch_threads") == 0


def test_load_runtime_sets_threads_before_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real model's start-up applies model.torch_threads first; a synthetic node never imports torch."""
    from pfec.common.model import runtime

    seen: list[int | None] = []
    monkeypatch.setattr(runtime, "set_torch_threads", lambda n: seen.append(n) or 1)
    runtime.load_runtime(runtime.SYNTHETIC_MODEL, torch_threads=2)
    assert seen == []

    class Stop(Exception):
        pass

    def no_model(*_a: object, **_k: object) -> None:
        raise Stop

    from pfec.common.model import llm

    monkeypatch.setattr(llm, "load_model", no_model)
    with pytest.raises(Stop):
        runtime.load_runtime("default", torch_threads=2)
    assert seen == [2]
