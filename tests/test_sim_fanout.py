"""The simulator's fan-out (issue 37 item 4): one uplink, a branch per receiver, coded (F's GroupSession and
real member sessions) and unicast (N real session pairs), each receiver beside its solo handoff and oracle
on the same losses."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.sim.channel import Bernoulli, LossModel
from pfec.lab.sim.fanout import FanoutConfig, simulate_fanout
from pfec.lab.sim.handoff import SimConfig

NONE = Bernoulli(0.0)


def _sim(losses: tuple[LossModel, ...], rho: float, fanouts: tuple[str, ...] = ("coded", "unicast"),
         tokens: int = 128, realizations: int = 1) -> dict[str, Any]:
    base = SimConfig(loss=losses[0], rho=rho, tokens=tokens, repair_budget=None)
    return simulate_fanout(FanoutConfig(base, losses), fanouts, realizations)


def _utils(result: dict[str, Any], name: str) -> list[float]:
    return [r["recovered_utility_mean"] for r in result["schemes"][name]["receivers"]]


def test_lossless_coded_sends_once_unicast_three_times() -> None:
    """Lossless with a loose deadline: everyone gets everything; the coded stream's uplink carries about
    one handoff, unicast about three."""
    result = _sim((NONE, NONE, NONE), rho=4.0)
    n = result["inputs"]["n_source"]
    schemes = result["schemes"]
    for name in ("coded", "unicast", "solo", "oracle"):
        assert _utils(result, name) == pytest.approx([1.0, 1.0, 1.0]), name
    solo = schemes["solo"]["uplink_datagrams_mean"]
    assert n <= solo <= 1.1 * n
    assert n <= schemes["coded"]["uplink_datagrams_mean"] <= 1.1 * solo
    assert schemes["unicast"]["uplink_datagrams_mean"] >= 2.9 * n
    assert schemes["coded"]["members_dropped"] == 0


def test_tight_deadline_lossy_receivers_bounded_by_their_oracles() -> None:
    """rho 0.8, three receivers at 2%, 8% and 15%: every scheme's utility is at most each receiver's
    oracle; unicast shares the uplink (a third each) and falls well below the solos."""
    losses = (Bernoulli(0.02), Bernoulli(0.08), Bernoulli(0.15))
    result = _sim(losses, rho=0.8)
    oracle = _utils(result, "oracle")
    for name in ("coded", "unicast", "solo"):
        assert all(u <= o + 1e-9 for u, o in zip(_utils(result, name), oracle, strict=True)), name
        assert all(0.0 <= u <= 1.0 for u in _utils(result, name))
    assert all(u < s - 0.1 for u, s in zip(_utils(result, "unicast"), _utils(result, "solo"), strict=True))
    assert [r["loss"] for r in result["schemes"]["coded"]["receivers"]] == [repr(x) for x in losses]


def test_one_receiver_unicast_is_the_solo_handoff() -> None:
    """With one receiver the unicast fan-out is one session on the whole uplink, on the solo's losses:
    the same handoff, up to the reverse path's serialisation (the solo's reverse link has a rate)."""
    for loss in (Bernoulli(0.05), Bernoulli(0.15)):
        result = _sim((loss,), rho=0.8, fanouts=("unicast",), tokens=256)
        assert _utils(result, "unicast") == pytest.approx(_utils(result, "solo"), abs=0.01), loss


def test_receivers_meet_their_own_losses() -> None:
    """Receiver i's losses are its own: a lossless receiver beside a lossy one recovers all of it."""
    base = SimConfig(loss=NONE, rho=4.0, tokens=128, repair_budget=None)
    result = simulate_fanout(FanoutConfig(base, (NONE, Bernoulli(0.3))), ("unicast",), 1)
    solo = _utils(result, "solo")
    assert solo[0] == pytest.approx(1.0)
    assert result["schemes"]["solo"]["receivers"][1]["uplink_datagrams_mean"] > (
        result["schemes"]["solo"]["receivers"][0]["uplink_datagrams_mean"] * 1.2)
    with pytest.raises(ValueError, match=r"receivers must be 1\.\.8"):
        FanoutConfig(base, ())
    with pytest.raises(ValueError, match="whole-cache handoff"):
        FanoutConfig(dataclasses.replace(base, mode="local"), (NONE,))


def test_sim_cmd_fanout_json() -> None:
    runner = CliRunner()
    args = ["sim", "--receivers", "3", "--fanout", "coded", "--tokens", "128", "--realizations", "1",
            "--loss", "bernoulli:0.02", "--loss", "bernoulli:0.08", "--loss", "bernoulli:0.15", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert set(out["schemes"]) == {"coded", "solo", "oracle", "group_oracle"}
    assert len(out["schemes"]["coded"]["receivers"]) == 3
    assert "recovered_utility_mean" in out["schemes"]["coded"]["receivers"][2]
    assert out["schemes"]["coded"]["uplink_datagrams_mean"] > 0
    assert out["inputs"]["losses"] == ["bernoulli:0.02", "bernoulli:0.08", "bernoulli:0.15"]
    res = runner.invoke(app, [*args[:-7], "--loss", "bernoulli:0.1", "--loss", "bernoulli:0.2"])
    assert res.exit_code == 2 and "once per receiver (3), got 2" in res.output
    res = runner.invoke(app, ["sim", "--loss", "bernoulli:0.1", "--loss", "bernoulli:0.2"])
    assert res.exit_code == 2 and "only with --receivers" in res.output
    res = runner.invoke(app, ["sim", "--receivers", "9"])
    assert res.exit_code == 2 and "--receivers must be 1..8" in res.output


def test_a_group_of_one_does_as_well_as_the_solo_handoff() -> None:
    """One member: the coded stream is that receiver's own handoff on the same losses, so its utility is
    at least the solo session's less a small margin (the repairs aim at its holes, none is wasted)."""
    for loss in (Bernoulli(0.05), Bernoulli(0.15)):
        base = SimConfig(loss=loss, rho=0.8, tokens=256)
        result = simulate_fanout(FanoutConfig(base, (loss,)), ("coded",), 2)
        coded, solo = _utils(result, "coded")[0], _utils(result, "solo")[0]
        assert coded >= solo - 0.02, (loss, coded, solo)


def test_each_member_near_what_a_group_sized_for_the_worst_can_give() -> None:
    """rho 0.8, 2%, 8% and 15% (the CLI's repair budget): the worst member gets about its solo, the others
    at least what the worst gets, and each is within 5% of the group oracle (the sources the worst
    receiver's arriving slots carry, which every member could decode)."""
    losses = (Bernoulli(0.02), Bernoulli(0.08), Bernoulli(0.15))
    base = SimConfig(loss=losses[0], rho=0.8, tokens=256)
    result = simulate_fanout(FanoutConfig(base, losses), ("coded",), 2)
    coded, solo, bound = (_utils(result, name) for name in ("coded", "solo", "group_oracle"))
    assert coded[2] >= solo[2] - 0.02, (coded, solo)
    assert min(coded[:2]) >= coded[2] - 0.005, coded
    assert all(c >= 0.95 * g for c, g in zip(coded, bound, strict=True)), (coded, bound)
    assert all(g <= o + 1e-9 for g, o in zip(bound, _utils(result, "oracle"), strict=True))
