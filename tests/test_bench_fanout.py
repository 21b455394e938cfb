"""`pfec bench fanout` on a tiny case (synthetic KV, one seed, two receivers): real daemons through the
fan-out relay, each receiver's solo handoff, the unicast and multicast fan-outs and the
simulator's figure; the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.pathbench.fanout import bursty_loss
from pfec.lab.sim.channel import parse_loss_spec


def test_bursty_loss_has_the_asked_mean() -> None:
    for p in (0.02, 0.08, 0.15):
        assert abs(getattr(parse_loss_spec(bursty_loss(p)), "mean_loss") - p) < 1e-5  # noqa: B009


def test_bench_fanout_tiny_case(tmp_path: Path) -> None:
    args = ["bench", "fanout", "--receivers", "2", "--model", "synthetic", "--tokens", "96", "--seeds", "1",
            "--sim-realizations", "1", "--rtt-ms", "4", "--out-dir", str(tmp_path), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "fanout.json").read_text())
    assert "| unicast |" in (tmp_path / "fanout.md").read_text()
    row = result["rows"][0]
    for i in range(2):
        solo = row[f"solo.{i}"]
        assert solo["outcome"] == "done", solo
        # The solo handoff reached its own receiver through its relay port, and only it.
        assert solo["branch_delivered"][i] > 0 and solo["branch_delivered"][1 - i] == 0, solo
        assert 0 < solo["receivers"][str(i)]["recovered_utility"] <= 1
    uni = row["unicast"]
    assert uni["outcome"] == "done" and all(d > 0 for d in uni["branch_delivered"]), uni
    assert set(uni["receivers"]) == {"0", "1"}
    assert uni["uplink_bytes"] > 0
    multi = row["multicast"]
    assert multi["outcome"] == "done" and all(d > 0 for d in multi["branch_delivered"]), multi
    assert set(multi["receivers"]) == {"0", "1"}
    sim = result["sim"]
    assert set(sim["schemes"]) == {"coded", "unicast", "solo", "oracle", "group_oracle"}
    assert len(sim["coded_vs_solo"]) == 2
    assert result["summary"]["per_seed"][0]["unicast_uplink_vs_solo"] is not None
