"""`pfec bench traces` (lab/pathbench/trace_handoffs.py), small: real daemons through the relay on a trace
this test makes, against the simulated oracle of the same start. Structure and bounds, not the figures."""

from __future__ import annotations

from pathlib import Path

from pfec.lab.pathbench.trace_handoffs import run_trace_bench, write_trace_bench
from pfec.lab.sim.rate_trace import step_trace


def test_each_start_gets_a_measuring_and_a_fixed_handoff_beside_the_simulated_oracle(tmp_path: Path) -> None:
    trace = step_trace([20.0, 40.0], 1.0)
    path = tmp_path / "steps.up"
    path.write_text("\n".join(str(int(t)) for t in trace.opportunities_ms) + "\n")
    result = run_trace_bench([(path, 1.0)], offsets=2, told_mbps=60.0, tokens=192, deadline_ms=800.0,
                             rtt_ms=20.0, sim_realizations=1)
    rows = result["rows"]
    assert [(r["start_s"], r["control"]) for r in rows] == [
        (0.0, "path"), (0.0, "fixed@mean"), (1.0, "path"), (1.0, "fixed@mean")]
    for row in rows:
        assert row["outcome"] == "done", row
        assert 0 < (row["recovered_utility"] or 0) <= 1 and 0 <= row["queue_drop_share"] <= 1
    for row in rows[::2]:
        assert 0 < row["sim_oracle_utility"] <= 1 and row["estimate_mbps"] is not None
    (summary,) = result["per_trace"]
    assert summary["trace"] == "steps.up" and summary["path_vs_sim_oracle"] is not None
    write_trace_bench(result, tmp_path)
    assert "| steps.up |" in (tmp_path / "traces.md").read_text()


def test_an_even_sender_far_below_the_mean_still_queues_through_an_outage() -> None:
    from pfec.lab.pathbench.trace_handoffs import paced_delay_p95_ms

    steady = step_trace([40.0, 40.0], 1.0)
    outage = step_trace([40.0, 0.0, 40.0], 0.3)  # 300 ms without a delivery opportunity
    assert paced_delay_p95_ms(steady, 0.25, 0.9) < 2
    assert paced_delay_p95_ms(outage, 0.25, 0.9) > 100
