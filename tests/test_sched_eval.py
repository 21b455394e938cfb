"""Held-out evaluation of the learned scheduler: disjoint from training, paired CI math, verdict, report."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.train.ddqn import TrainConfig, draw_episode
from pfec.lab.train.episodes import outside_support
from pfec.lab.train.held_out import (
    HELDOUT_CONDITIONS,
    HELDOUT_SEED,
    HeldoutCondition,
    heldout_comparison,
    paired_summary,
    render_markdown,
    verdict,
)


def test_heldout_conditions_lie_outside_the_training_distribution() -> None:
    ranges = TrainConfig().ranges  # the distribution `pfec train` draws from by default
    for cond in HELDOUT_CONDITIONS:
        assert cond.outside(ranges), f"{cond.name} could be drawn by training"
    assert len({c.name for c in HELDOUT_CONDITIONS}) == len(HELDOUT_CONDITIONS)
    # The check can fail: every condition training actually draws lies inside the support.
    rng = np.random.default_rng(3)
    for _ in range(300):
        ep = draw_episode(TrainConfig(), rng)
        assert outside_support(ranges, ep.tokens, ep.rate_mbps, ep.rtt_ms, ep.rho, ep.loss) == []
    # The conditions are represented: long RTT, short deadlines and long bursts beyond training.
    assert any(c.rtt_ms > ranges.rtt_ms[1] for c in HELDOUT_CONDITIONS)
    assert any(c.rho < ranges.rho[0] for c in HELDOUT_CONDITIONS)
    assert any(c.ge[3] < ranges.p_bg[0] for c in HELDOUT_CONDITIONS)


def test_training_refuses_the_heldout_seed() -> None:
    with pytest.raises(ValueError, match="held-out"):
        TrainConfig(seed=HELDOUT_SEED)


def test_paired_summary_ci_on_synthetic_pairs() -> None:
    heuristic = [0.5, 0.6, 0.7, 0.8, 0.9]
    diffs = [0.01, 0.02, 0.00, 0.03, 0.04]  # mean 0.02, sd 0.0158114
    ddqn = [h + d for h, d in zip(heuristic, diffs, strict=True)]
    s = paired_summary(ddqn, heuristic)
    half = 2.776 * 1.58114 / math.sqrt(5)  # t(0.975, 4) * sd / sqrt(n), in points
    assert s["n"] == 5
    assert s["diff_points_mean"] == pytest.approx(2.0)
    assert s["diff_points_ci95"] == pytest.approx([2.0 - half, 2.0 + half], abs=1e-4)
    assert (s["ddqn_better"], s["heuristic_better"]) == (4, 0)
    assert verdict(s) == {"winner": "priorityfec", "default_scheme": "priorityfec", "never_worse": True}
    with pytest.raises(ValueError, match="equal"):
        paired_summary([0.1], [0.1, 0.2])


@pytest.mark.parametrize(("diffs", "winner", "never_worse"), [
    ([-0.03, -0.02, -0.04, -0.03], "heuristic", False),
    ([0.001, -0.001, 0.002, -0.002], "tie", True),
    ([0.02, -0.03, 0.01, -0.02], "tie", False),
])
def test_verdict_and_report_say_who_won(diffs: list[float], winner: str, never_worse: bool) -> None:
    heuristic = [0.5] * len(diffs)
    pooled = paired_summary([0.5 + d for d in diffs], heuristic)
    v = verdict(pooled)
    assert v["winner"] == winner and v["never_worse"] is never_worse
    assert v["default_scheme"] == "heuristic"
    pooled["decision_disagreement"] = 0.1
    cond = {**pooled, "name": "c", "tokens": 1, "rate_mbps": 1.0, "rtt_ms": 1.0, "rho": 1.0,
            "ge": [0.0, 0.5, 0.1, 0.1], "decision_disagreement": 0.1}
    text = render_markdown({"pooled": pooled, "conditions": [cond], "weights": {}, **v})
    assert ("never worse by more than half a point" in text) is never_worse
    assert ("Neither scheme wins" in text) is (winner == "tie")
    assert ("heuristic beats the DDQN" in text) is (winner == "heuristic")
    assert "default scheme is `heuristic`" in text


def test_heldout_comparison_runs_paired_and_refuses_leaks() -> None:
    tiny = HeldoutCondition("tiny", 40, 100.0, 300.0, 0.7, (0.001, 0.5, 0.02, 0.1))
    result = heldout_comparison(realizations=2, conditions=[tiny])
    (c,) = result["conditions"]
    assert c["n"] == 2 and result["pooled"]["n"] == 2 and c["decisions"] > 0
    assert 0.0 <= c["decision_disagreement"] <= 1.0
    assert "tokens 40" in " ".join(c["outside_training"])
    assert result["winner"] in ("priorityfec", "heuristic", "tie")
    inside = HeldoutCondition("leak", 128, 100.0, 20.0, 0.8, (0.001, 0.5, 0.02, 0.1))
    with pytest.raises(ValueError, match="inside the training distribution"):
        heldout_comparison(realizations=2, conditions=[inside])


def test_train_cli_refuses_bad_values_with_the_fix(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["train", "--episodes", "0", "--out", str(tmp_path / "w.npz")])
    assert bad.exit_code != 0 and "episodes=0" in bad.output
    missing = runner.invoke(app, ["train", "--evaluate", "--out", str(tmp_path / "none.npz")])
    assert missing.exit_code != 0 and "does not exist" in missing.output
    assert not (tmp_path / "w.npz").exists()


def test_the_daemons_default_scheme_is_the_one_the_committed_held_out_comparison_chose() -> None:
    """The sender's default scheme follows the recorded DDQN-vs-heuristic verdict, not a guess."""
    import json

    from pfec.common.node.config_models import SenderFecConfig
    from pfec.lab.train.held_out import EVAL_PATH

    recorded = json.loads(EVAL_PATH.read_text())
    assert SenderFecConfig().scheme == recorded["default_scheme"], recorded["pooled"]
