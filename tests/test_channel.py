"""Tests for lab/sim/channel.py: loss models, traces, specs, seeded streams."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from pfec.lab.sim import channel
from pfec.lab.sim.channel import (
    MAIN_GE,
    Bernoulli,
    GilbertElliott,
    LossModel,
    TraceReplay,
    load_trace,
    parse_loss_spec,
    realization_rng,
    write_trace,
)


def loss_runs(lost: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """Lengths of the runs of consecutive True values."""
    x = np.concatenate(([False], lost, [False])).astype(np.int8)
    d = np.diff(x)
    return (np.flatnonzero(d == -1) - np.flatnonzero(d == 1)).astype(np.int64)


# --------------------------------------------------------------------------- statistics


def test_main_ge_mean_loss_formula() -> None:
    assert GilbertElliott(0.001, 0.50, 0.02, 0.10) == MAIN_GE
    assert MAIN_GE.mean_loss == pytest.approx(0.0841667, abs=1e-6)
    assert MAIN_GE.pi_bad == pytest.approx(1 / 6)
    lost = MAIN_GE.realize(2_000_000, 1e-3, realization_rng(1, 0, "forward"))
    assert lost.dtype == np.bool_ and lost.shape == (2_000_000,)
    assert abs(lost.mean() - MAIN_GE.mean_loss) < 0.005


def test_ge_state_occupancy_and_sojourns() -> None:
    ge = GilbertElliott(0.0, 1.0, 0.05, 0.25)  # losses == Bad state
    lost = ge.realize(1_000_000, 1e-3, realization_rng(2, 0, "forward"))
    assert abs(lost.mean() - ge.pi_bad) < 0.01
    runs = loss_runs(lost)
    assert runs.mean() == pytest.approx(ge.mean_bad_sojourn, rel=0.05)  # 1/p_bg = 4
    assert ge.mean_burst == pytest.approx(4.0)


def test_ge_bursts_longer_than_bernoulli_at_equal_rate() -> None:
    ge_lost = MAIN_GE.realize(1_000_000, 1e-3, realization_rng(3, 0, "forward"))
    b = Bernoulli(MAIN_GE.mean_loss)
    b_lost = b.realize(1_000_000, 1e-3, realization_rng(3, 0, "forward"))
    ge_burst, b_burst = loss_runs(ge_lost).mean(), loss_runs(b_lost).mean()
    assert ge_burst == pytest.approx(MAIN_GE.mean_burst, rel=0.05)  # about 1.80
    assert b_burst == pytest.approx(b.mean_burst, rel=0.03)  # about 1.09
    assert ge_burst > 1.4 * b_burst


def test_bernoulli_rate() -> None:
    for p in (0.0, 0.05, 0.3, 1.0):
        lost = Bernoulli(p).realize(200_000, 1e-3, realization_rng(4, 0, "forward"))
        assert abs(lost.mean() - p) < 0.005
    assert Bernoulli(0.2).mean_loss == 0.2


def test_ge_absorbing_and_degenerate_cases() -> None:
    rng = realization_rng(5, 0, "forward")
    assert not GilbertElliott(0.0, 1.0, 0.0, 0.5).realize(10_000, 1e-3, rng).any()  # stays Good
    assert GilbertElliott(0.0, 1.0, 0.5, 0.0).realize(10_000, 1e-3, rng).all()  # stays Bad
    assert GilbertElliott(0.0, 1.0, 1.0, 1.0).realize(10, 1e-3, rng).tolist() in (
        [True, False] * 5,
        [False, True] * 5,
    )
    for model in (MAIN_GE, Bernoulli(0.5)):
        assert model.realize(0, 1e-3, rng).shape == (0,)


def test_ge_realize_is_fast() -> None:
    rng = realization_rng(6, 0, "forward")
    MAIN_GE.realize(30_000, 1e-3, rng)
    best = min(_timed(lambda: MAIN_GE.realize(30_000, 1e-3, rng)) for _ in range(5))
    assert best < 0.010, f"GE realize of 30k slots took {best * 1e3:.2f} ms"


def _timed(f: object) -> float:
    assert callable(f)
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


# --------------------------------------------------------------------------- seeding


@pytest.mark.parametrize("model", [MAIN_GE, Bernoulli(0.1)])
def test_determinism_and_prefix(model: LossModel) -> None:
    a = model.realize(50_000, 1e-3, realization_rng(7, 3, "forward"))
    b = model.realize(50_000, 1e-3, realization_rng(7, 3, "forward"))
    assert np.array_equal(a, b)
    short = model.realize(1_234, 1e-3, realization_rng(7, 3, "forward"))
    assert np.array_equal(short, a[:1_234])  # callers asking for fewer slots see the same prefix
    for key in [(7, 4, "forward"), (7, 3, "reverse"), (8, 3, "forward")]:
        assert not np.array_equal(model.realize(50_000, 1e-3, realization_rng(*key)), a)


def test_streams_independent() -> None:
    keys = [(1, 0, "forward"), (1, 0, "reverse"), (1, 0, "control"), (1, 1, "forward"), (2, 0, "forward")]
    vals = [realization_rng(*key).random(100_000) for key in keys]
    for i in range(len(vals)):
        for j in range(i + 1, len(vals)):
            assert abs(np.corrcoef(vals[i], vals[j])[0, 1]) < 0.02
    a = MAIN_GE.realize(200_000, 1e-3, realization_rng(9, 0, "forward"))
    b = MAIN_GE.realize(200_000, 1e-3, realization_rng(9, 0, "reverse"))
    both = float(np.mean(a & b))
    assert both == pytest.approx(a.mean() * b.mean(), abs=0.004)


def test_realization_rng_validation_and_stability() -> None:
    first = realization_rng(123, 0, "forward").integers(0, 1 << 62, size=3).tolist()
    assert first == realization_rng(123, 0, "forward").integers(0, 1 << 62, size=3).tolist()
    for bad in [(-1, 0, "f"), (0, -1, "f"), (0, 0, ""), (True, 0, "f")]:
        with pytest.raises(ValueError):
            realization_rng(*bad)


# --------------------------------------------------------------------------- traces


def test_trace_round_trip_and_replay_follows_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n, dt = 500, 0.002
    times = np.arange(n) * dt
    lost = rng.random(n) < 0.2
    path = tmp_path / "t.trace"
    write_trace(path, times, lost, comment="unit test\nsecond line")
    text = path.read_text().splitlines()
    assert text[0] == "# pfec-loss-trace v1" and text[1] == "# unit test"
    tr = load_trace(path)
    assert np.array_equal(tr.times_s, times) and np.array_equal(tr.lost, lost)
    assert tr.period_s == pytest.approx(n * dt)
    assert tr.mean_loss == pytest.approx(lost.mean())
    # the realization spans exactly one period: offset 0, the file replays verbatim
    out = tr.realize(n, dt, realization_rng(1, 0, "forward"))
    assert np.array_equal(out, lost)
    # half-spacing slots see every entry twice
    assert np.array_equal(tr.realize(2 * n, dt / 2, realization_rng(1, 0, "forward")), np.repeat(lost, 2))
    # longer than the trace: wraps around, i.e. a rotation of the tiled file
    wrapped = tr.realize(3 * n + 17, dt, realization_rng(2, 0, "forward"))
    tiled = np.tile(lost, 5)
    assert any(np.array_equal(wrapped, tiled[k : k + 3 * n + 17]) for k in range(n))
    # shorter than the trace: a contiguous window of the file
    window = tr.realize(100, dt, realization_rng(3, 0, "forward"))
    assert any(np.array_equal(window, lost[k : k + 100]) for k in range(n - 99))
    assert np.array_equal(window, tr.realize(100, dt, realization_rng(3, 0, "forward")))


def test_trace_piecewise_constant(tmp_path: Path) -> None:
    path = tmp_path / "pw.trace"
    path.write_text(
        "# pfec-loss-trace v1\n# irregular times\ntime_s,lost\n0.0,0\n1.0,1\n1.0,0\n1.0,1\n1.5,0\n\n3.0,0\n"
    )
    tr = load_trace(path)
    assert tr.period_s == pytest.approx(3.0 * 6 / 5)
    tr2 = TraceReplay(np.array([0.0, 1.0, 1.5, 3.0]), np.array([0, 1, 0, 0]), "x")
    assert tr2.period_s == pytest.approx(4.0)
    out = tr2.realize(8, 0.5, realization_rng(0, 0, "forward"))
    assert out.tolist() == [False, False, True, False, False, False, False, False]
    # equal times: the last entry at that time wins
    assert bool(tr.realize(6, 0.6, realization_rng(0, 0, "forward"))[2]) is True  # t=1.2 -> (1.0, 1)
    const = TraceReplay(np.array([5.0]), np.array([True]), "c")
    assert const.realize(10, 1.0, realization_rng(0, 0, "f")).all()


@pytest.mark.parametrize(
    ("content", "line", "needle"),
    [
        ("# pfec-loss-trace v2\n0,0\n", 1, "v2"),
        ("time_s,lost\n0,0\n", 1, "time_s,lost"),
        ("", 1, "pfec-loss-trace"),
        ("# pfec-loss-trace v1\n0.0,0\n0.5,1\n0.4,0\n", 4, "'0.4'"),
        ("# pfec-loss-trace v1\n0.0,0\n0.5,2\n", 3, "'2'"),
        ("# pfec-loss-trace v1\n0.0,0\n0.5,yes\n", 3, "'yes'"),
        ("# pfec-loss-trace v1\nabc,0\n", 2, "'abc'"),
        ("# pfec-loss-trace v1\nnan,0\n", 2, "'nan'"),
        ("# pfec-loss-trace v1\n0.0,0,1\n", 2, "0.0,0,1"),
        ("# pfec-loss-trace v1\n0.0,0\n# late comment\n", 3, "# late comment"),
    ],
)
def test_trace_errors_name_file_line_value(tmp_path: Path, content: str, line: int, needle: str) -> None:
    path = tmp_path / "bad.trace"
    path.write_text(content)
    with pytest.raises(ValueError) as ei:
        load_trace(path)
    msg = str(ei.value)
    assert f"{path}:{line}" in msg and needle in msg


def test_trace_without_data(tmp_path: Path) -> None:
    path = tmp_path / "empty.trace"
    path.write_text("# pfec-loss-trace v1\n# nothing\n")
    with pytest.raises(ValueError, match="no data"):
        load_trace(path)


def test_trace_replay_validation() -> None:
    with pytest.raises(ValueError):
        TraceReplay(np.array([1.0, 0.0]), np.array([0, 0]), "dec")
    with pytest.raises(ValueError):
        TraceReplay(np.array([0.0]), np.array([0, 1]), "len")
    with pytest.raises(ValueError):
        TraceReplay(np.array([0.0]), np.array([2]), "val")
    with pytest.raises(ValueError):
        TraceReplay(np.array([]), np.array([]), "empty")


# --------------------------------------------------------------------------- specs


def test_parse_loss_spec_valid(tmp_path: Path) -> None:
    assert parse_loss_spec("bernoulli:0.05") == Bernoulli(0.05)
    assert parse_loss_spec(" ge:0.001, 0.5, 0.02, 0.1 ") == MAIN_GE
    path = tmp_path / "s.trace"
    write_trace(path, [0.0, 1.0], [0, 1])
    tr = parse_loss_spec(f"trace:{path}")
    assert isinstance(tr, TraceReplay) and tr.lost.tolist() == [False, True]
    for model in (Bernoulli(0.1), MAIN_GE, tr):
        assert isinstance(model, LossModel)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "expected"),
        ("bernoulli", "expected"),
        ("uniform:0.1", "'uniform'"),
        ("bernoulli:x", "'x'"),
        ("bernoulli:1.5", "'1.5'"),
        ("bernoulli:-0.1", "'-0.1'"),
        ("bernoulli:nan", "'nan'"),
        ("bernoulli:0.1,0.2", "bernoulli:P"),
        ("ge:0.1,0.2,0.3", "ge:EG,EB,PGB,PBG"),
        ("ge:0.1,0.2,0.3,2", "'2'"),
        ("ge:0.1,0.2,0,0", "PGB + PBG"),
        ("trace:", "trace:PATH"),
        ("trace:/nonexistent/x.trace", "/nonexistent/x.trace"),
    ],
)
def test_parse_loss_spec_errors(spec: str, needle: str) -> None:
    with pytest.raises(ValueError) as ei:
        parse_loss_spec(spec)
    assert needle in str(ei.value) and repr(spec) in str(ei.value)


def test_model_validation() -> None:
    with pytest.raises(ValueError):
        GilbertElliott(0.1, 0.5, 0.0, 0.0)
    with pytest.raises(ValueError):
        GilbertElliott(0.1, 1.5, 0.1, 0.1)
    with pytest.raises(ValueError):
        Bernoulli(-0.01)
    with pytest.raises(ValueError):
        Bernoulli(0.1).realize(-1, 1e-3, np.random.default_rng(0))
    with pytest.raises(ValueError):
        MAIN_GE.realize(10, 0.0, np.random.default_rng(0))


def test_sans_io_imports() -> None:
    src = Path(channel.__file__).read_text()
    names: set[str] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"asyncio", "socket", "time", "torch"}
