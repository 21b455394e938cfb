"""Double-DQN scheduler: features, compiled inference vs torch, masks, weights, training, bench CLI."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.common.sched.actions import N_ACTIONS, Action, SchedulerView
from pfec.common.sched.ddqn import (
    MASK_AT,
    N_PARAMS,
    SCRATCH_SIZE,
    WEIGHTS_PATH,
    DDQNPolicy,
    flatten_weights,
    greedy_action,
    load_weights,
    write_features_compiled,
)
from pfec.common.sched.features import (
    FEATURE_HIGH,
    FEATURE_LOW,
    N_FEATURES,
    new_feature_buffer,
    write_features,
)
from pfec.common.sched.policies import SCHEMES, Scheme
from pfec.lab.sim.channel import MAIN_GE
from pfec.lab.sim.simulate import SimConfig, prepare, run_once, simulate
from pfec.lab.train.ddqn import Agent, QNet, TrainConfig, TrainingPolicy, _run_episode, draw_episode, train
from pfec.lab.train.held_out import HELDOUT_SEED


class Recorder:
    """Delegates to the DDQN and keeps (data datagrams sent so far, features, view copy) per decision."""

    name = "recorder"
    sends_repairs = True

    def __init__(self) -> None:
        self.inner = DDQNPolicy()
        self.rows: list[tuple[int, npt.NDArray[np.float32], SchedulerView]] = []

    def decide(self, view: SchedulerView) -> Action:
        x = new_feature_buffer()
        write_features(view, x)
        snapshot = copy.copy(view)
        snapshot.mask = list(view.mask)
        self.rows.append((view.sources_sent + view.repairs_sent, x, snapshot))
        return self.inner.decide(view)

    def reset(self) -> None:
        pass


def _record(config: SimConfig, realization: int = 0) -> Recorder:
    recorder = Recorder()
    scheme = Scheme("rec", "utility", lambda: recorder, "test")
    run_once(prepare(config), scheme, realization, verify=False)
    return recorder


@pytest.fixture(scope="module")
def recorded() -> Recorder:
    return _record(SimConfig(loss=MAIN_GE, rho=0.7, tokens=96))


def _random_view(rng: np.random.Generator) -> SchedulerView:
    n = int(rng.integers(1, 5000))
    total = int(rng.integers(0, 6000))
    budget = int(rng.integers(0, 800))
    view = SchedulerView(
        n_source=n,
        sources_sent=int(rng.integers(0, n + 1)),
        slots_total=total,
        slots_left=int(rng.integers(0, total + 1)),
        repair_budget=budget,
        repairs_left=int(rng.integers(0, budget + 1)),
        deficit_estimate=float(rng.exponential(10.0)),
        loss_estimate=float(rng.random()),
        burst_estimate=float(1.0 + rng.exponential(3.0)),
        window_size=int(rng.integers(0, 5000)),
        window_at_feedback=int(rng.integers(0, 5000)),
        rtt_estimate=float(rng.choice([0.0, rng.uniform(0.001, 0.1)])),
        ack_staleness=float(rng.exponential(0.05)),
        block_progress=float(rng.random()),
        block_utility=float(rng.random()),
        upcoming_utility=float(rng.random()),
        repair_effectiveness=float(rng.random()),
    )
    view.update_mask()
    return view


def test_features_in_range_for_random_and_recorded_views(recorded: Recorder) -> None:
    rng = np.random.default_rng(1)
    rows = [r[1] for r in recorded.rows]
    for _ in range(3000):
        x = new_feature_buffer()
        write_features(_random_view(rng), x)
        rows.append(x)
    feats = np.stack(rows)
    assert np.isfinite(feats).all()
    assert (feats >= FEATURE_LOW).all() and (feats <= FEATURE_HIGH).all()
    assert feats.shape[1] == N_FEATURES == 15
    # Every feature moves over the recorded and random states (none is a constant).
    assert (feats.std(axis=0) > 1e-3).all()


class _SplitLoss:
    """Loss vectors equal for the first ``split`` data datagrams, then different per ``variant``."""

    def __init__(self, split: int, variant: int) -> None:
        base = MAIN_GE.realize(50_000, 1.0, np.random.default_rng(5))
        tail = MAIN_GE.realize(50_000, 1.0, np.random.default_rng(100 + variant))
        self.lost = np.concatenate([base[:split], tail[split:]])
        self.lost[:64] = False  # the OFFER's control stream draws from the same model: let it through

    def realize(self, n_slots: int, slot_s: float, rng: np.random.Generator) -> npt.NDArray[np.bool_]:
        return self.lost[:n_slots].copy()


def test_features_are_causal() -> None:
    """Decisions before the first differing datagram is sent see identical features; later ones differ."""
    split = 700
    runs = [_record(SimConfig(loss=_SplitLoss(split, v), rho=0.8, tokens=96)) for v in (0, 1)]
    before = [[x for sent, x, _v in r.rows if sent <= split] for r in runs]
    assert len(before[0]) == len(before[1]) > 20
    for a, b in zip(*before, strict=True):
        np.testing.assert_array_equal(a, b)
    after = [np.stack([x for sent, x, _v in r.rows if sent > split]) for r in runs]
    n = min(len(after[0]), len(after[1]))
    assert not np.array_equal(after[0][:n], after[1][:n])


def _torch_greedy(net: QNet, x: npt.NDArray[np.float32], masks: npt.NDArray[np.bool_]
                  ) -> npt.NDArray[np.int64]:
    with torch.no_grad():
        q = net(torch.from_numpy(x)).masked_fill(~torch.from_numpy(masks), -math.inf)
    return np.asarray(q.argmax(dim=1).numpy(), dtype=np.int64)


def _numba_greedy(params: npt.NDArray[np.float32], x: npt.NDArray[np.float32], masks: npt.NDArray[np.bool_]
                  ) -> npt.NDArray[np.int64]:
    scratch = np.zeros(SCRATCH_SIZE, dtype=np.float32)
    out = np.empty(len(x), dtype=np.int64)
    for i in range(len(x)):
        scratch[:N_FEATURES] = x[i]
        scratch[MASK_AT:MASK_AT + N_ACTIONS] = masks[i]
        out[i] = greedy_action(params, scratch)
    return out


@pytest.mark.parametrize("weights", ["committed", "random-init"])
def test_numba_greedy_equals_torch_argmax(weights: str, recorded: Recorder) -> None:
    torch.manual_seed(3)
    net = QNet()
    if weights == "committed":
        with np.load(WEIGHTS_PATH) as data:
            net.load_layers({k: data[k] for k in ("w1", "b1", "w2", "b2", "w3", "b3")})
    params = flatten_weights(net.layers())
    rng = np.random.default_rng(2)
    n_random = 12_000
    x_random = rng.uniform(FEATURE_LOW, FEATURE_HIGH, (n_random, N_FEATURES)).astype(np.float32)
    masks_random = rng.random((n_random, N_ACTIONS)) < 0.6
    masks_random[~masks_random.any(axis=1), 0] = True
    x_rec = np.stack([r[1] for r in recorded.rows])
    masks_rec = np.array([r[2].mask for r in recorded.rows], dtype=np.bool_)
    x = np.concatenate([x_random, x_rec])
    masks = np.concatenate([masks_random, masks_rec])
    ours = _numba_greedy(params, x, masks)
    np.testing.assert_array_equal(ours, _torch_greedy(net, x, masks))
    assert masks[np.arange(len(x)), ours].all()
    assert len(set(ours.tolist())) > 1 or weights == "committed"


def test_masked_actions_are_never_chosen() -> None:
    rng = np.random.default_rng(4)
    params = rng.standard_normal(N_PARAMS).astype(np.float32)
    scratch = np.zeros(SCRATCH_SIZE, dtype=np.float32)
    for bits in range(1, 2**N_ACTIONS):
        allowed = [(bits >> a) & 1 == 1 for a in range(N_ACTIONS)]
        for _ in range(200):
            scratch[:N_FEATURES] = rng.uniform(FEATURE_LOW, FEATURE_HIGH)
            scratch[MASK_AT:MASK_AT + N_ACTIONS] = allowed
            assert allowed[greedy_action(params, scratch)]
    scratch[MASK_AT:MASK_AT + N_ACTIONS] = 0.0
    assert greedy_action(params, scratch) == -1
    view = SchedulerView()
    view.update_mask()
    with pytest.raises(ValueError, match="no action is allowed"):
        DDQNPolicy(params).decide(view)


def test_weights_file_has_5444_parameters() -> None:
    assert WEIGHTS_PATH.exists()
    params = load_weights()
    assert params.shape == (N_PARAMS,) == (5444,) and params.dtype == np.float32
    assert np.isfinite(params).all()
    assert sum(p.numel() for p in QNet().parameters()) == 5444


def test_bad_weights_are_rejected_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pfec train"):
        load_weights(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    layers = QNet().layers()
    layers["w2"] = layers["w2"][:, :10]
    np.savez(bad, w1=layers["w1"], b1=layers["b1"], w2=layers["w2"], b2=layers["b2"],
             w3=layers["w3"], b3=layers["b3"])
    with pytest.raises(ValueError, match="15-64-64-4"):
        load_weights(bad)


def test_ddqn_schemes_run_in_a_short_simulation() -> None:
    assert SCHEMES["priorityfec"].order == "utility" and SCHEMES["rl-fec"].order == "fifo"
    result = simulate(SimConfig(loss=MAIN_GE, rho=0.8, tokens=64), ["priorityfec", "rl-fec"], 2)
    for name in ("priorityfec", "rl-fec"):
        s = result["schemes"][name]
        assert s["failures"] == 0
        assert 0.0 < s["recovered_utility_mean"] <= 1.0
        assert s["repair_sent_mean"] > 0


def test_episode_return_telescopes_to_recovered_utility() -> None:
    """gamma = 1 and F(terminal) = 0: the rewards of one episode sum to the receiver's recovered utility."""
    cfg = TrainConfig(episodes=1, heuristic_episodes=0, tokens=(32,), seed=3)
    agent = Agent(cfg)
    policy = TrainingPolicy(agent)
    episode = draw_episode(cfg, np.random.default_rng(0))
    _handoff, utility = _run_episode(agent, policy, episode, 0, heuristic=True, epsilon=0.0)
    rewards = agent.replay.r[: agent.replay.size]
    assert agent.replay.size > 10 and agent.replay.done[agent.replay.size - 1] == 1.0
    assert float(rewards.sum()) == pytest.approx(utility, abs=1e-4)


def test_training_is_seeded_and_writes_weights_and_log(tmp_path: Path) -> None:
    cfg = TrainConfig(episodes=2, heuristic_episodes=1, tokens=(32,), seed=7, learn_every=4, batch_size=16,
                      pretrain_updates=20, validate_every=1, validation_episodes=1)
    outs = []
    for run in range(2):
        weights, log = tmp_path / f"w{run}.npz", tmp_path / f"l{run}.jsonl"
        summary = train(cfg, weights, log, command="test")
        assert summary["updates"] > 0
        outs.append((load_weights(weights), log.read_text()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])  # same seed, one thread: the same weights
    lines = [json.loads(line) for line in outs[0][1].splitlines()]
    assert [r["phase"] for r in lines] == [
        "meta", "heuristic", "validate", "ddqn", "validate", "ddqn", "validate", "done"]
    assert lines[0]["warm_start"].startswith("imitation") and lines[0]["command"] == "test"
    assert {"episode", "epsilon", "return", "loss"} <= set(lines[-3])
    assert {"utility", "heuristic"} <= set(lines[-2])
    # The best RL checkpoint is kept (the imitation one is validated but not eligible by default).
    best = max(r["utility"] for r in lines if r["phase"] == "validate" and r["stage"] == "rl")
    assert summary["validation_utility"] == pytest.approx(best, abs=1e-6)
    assert summary["checkpoint_episode"] in (1, 2)
    with np.load(tmp_path / "w0.npz") as data:
        meta = json.loads(str(data["meta"]))
    assert meta["warm_start"].startswith("imitation") and meta["checkpoint_episode"] in (1, 2)


def test_training_from_a_random_network_says_so(tmp_path: Path) -> None:
    cfg = TrainConfig(episodes=2, heuristic_episodes=0, tokens=(32,), seed=2,
                      learn_every=4, batch_size=16, validate_every=2, validation_episodes=1)
    summary = train(cfg, tmp_path / "w.npz", tmp_path / "l.jsonl")
    assert summary["warm_start"] == "random network, RL only" and summary["updates"] > 0
    assert load_weights(tmp_path / "w.npz").shape == (N_PARAMS,)


@pytest.mark.parametrize(("field", "value"), [
    ("episodes", 0), ("lr", 0.0), ("gamma", 1.5), ("eps_start", 2.0), ("batch_size", 0),
    ("rtt_ms", (0.0, 10.0)), ("rtt_ms", (50.0, 10.0)), ("rho", (1.0, 0.5)), ("eps_b", (0.5, 1.2)),
    ("p_bg", (-0.1, 0.2)), ("tokens", ()), ("rates_mbps", (0.0,)), ("fifo_share", 1.5),
    ("rl_demo_weight", -1.0), ("seed", HELDOUT_SEED),
])
def test_training_config_refuses_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"training {field}=.* is invalid"):
        TrainConfig(**{field: value})  # type: ignore[arg-type]


def test_pretraining_on_demonstrations_imitates_the_heuristic() -> None:
    """The large-margin loss alone (no own episodes yet) makes the greedy net pick the heuristic's action on
    the demonstration states it was trained on; a fresh random net does not."""
    cfg = TrainConfig(episodes=1, heuristic_episodes=3, tokens=(64,), seed=5, batch_size=64)
    agent = Agent(cfg)
    policy = TrainingPolicy(agent)
    rng = np.random.default_rng(1)
    for i in range(cfg.heuristic_episodes):
        _run_episode(agent, policy, draw_episode(cfg, rng), i, heuristic=True, epsilon=0.0)
    rp = agent.replay
    n = rp.size

    def agreement() -> float:
        q = agent.learner.online(torch.from_numpy(rp.x[:n])).detach().numpy()
        q[~rp.m[:n]] = -np.inf
        return float(np.mean(q.argmax(axis=1) == rp.a[:n]))

    before = agreement()
    for _ in range(1500):
        agent.learner.update()
    after = agreement()
    assert after >= 0.9 and after > before, (before, after)


def test_bench_scheduler_cli_json(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "scheduler", "--json", "--out-dir", str(tmp_path), "--realizations", "1", "--passes", "1"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"decision_us_mean", "decision_us_p99", "machine"} <= set(data)
    assert data["states"] > 0 and 0 < data["decision_us_mean"] < 10_000
    assert (tmp_path / "scheduler.json").exists() and (tmp_path / "scheduler.md").exists()


def test_compiled_decision_equals_python_features_and_network(recorded: Recorder) -> None:
    """The deployed decision computes the features inside the compiled call: they must equal
    features.write_features bit for bit (training uses that one), and so must the chosen action."""
    rng = np.random.default_rng(11)
    views = [row[2] for row in recorded.rows] + [_random_view(rng) for _ in range(3000)]
    params = load_weights()
    policy = DDQNPolicy(params)
    scratch = np.zeros(SCRATCH_SIZE, dtype=np.float32)
    compiled = np.zeros(SCRATCH_SIZE, dtype=np.float32)
    for view in views:
        if not any(view.mask):
            continue
        write_features(view, scratch)
        write_features_compiled(
            compiled, view.repairs_left, view.repair_budget, view.slots_left, view.slots_total, view.n_source,
            view.sources_sent, view.deficit_estimate, view.loss_estimate, view.burst_estimate,
            view.window_size, view.window_at_feedback, view.ack_staleness, view.rtt_estimate,
            view.block_progress, view.block_utility, view.upcoming_utility, view.repair_effectiveness,
        )
        np.testing.assert_array_equal(compiled[:N_FEATURES], scratch[:N_FEATURES])
        scratch[MASK_AT:MASK_AT + N_ACTIONS] = view.mask
        assert int(policy.decide(view)) == greedy_action(params, scratch)
