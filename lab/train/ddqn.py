"""Double-DQN training of the repair scheduler by reinforcement learning (paper IV-C, IV-D and V-B).

Reproduce the committed weights (``common/sched/ddqn_weights.npz``) and log
(``docs/training/ddqn_train_log.jsonl``) with::

    nice -n 5 timeout 1500 .venv/bin/pfec train --seed 0    # the defaults below; wall time in the log

Each episode is one simulated handoff through ``lab.sim.simulate.run_once``: the real ``SenderSession`` asks
the learning policy for every decision, the real receiver and GF(2^8) codec decode, and the link is paced
and lossy in simulated time. Episodes come from the training distribution of ``lab/train/episodes.py``
(RTT log-uniform 5-200 ms, rho 0.3-1.3, bursty Gilbert-Elliott channels, four link rates, contexts of a few
hundred tokens); the held-out conditions of ``lab/train/held_out.py`` lie outside it.

Reward (gamma = 1): the change of recovered utility J plus potential shaping F (paper IV-C3),

    r_t = J_{t+1} - J_t + F(x_{t+1}) - F(x_t),
    F(x) = lp * k_dec / N - ld * d / max(1, d + B_rem) - lw * log(1 + W) / log(1 + N),

where k_dec is the ACKed decoded prefix, d the deficit estimate, W the unresolved window at the last
feedback and N the source symbols. J_t is the utility of the blocks inside the ACKed prefix (what the
sender can know); the last transition of an episode is terminal (F = 0) and pays the receiver's true
recovered utility at the deadline, so an episode's return is the recovered utility itself (the shaping
telescopes away and cannot change the optimal policy).

Stages. (1) Imitation warm start (DQfD style, the paper's "pretraining stage"): the replay memory is
seeded with ``heuristic_episodes`` trajectories of the deficit heuristic and the network is trained on them
alone for ``pretrain_updates`` updates of TD loss plus a large-margin loss that ranks the heuristic's action
above every other allowed action by ``margin`` (weight ``demo_weight``). ``pretrain_updates=0`` and
``heuristic_episodes=0`` start RL from a random network instead; the weights' meta records which
(``warm_start``). (2) RL: Double DQN on the agent's own epsilon-greedy episodes (the demonstrations stay in
the replay as off-policy data; their margin loss keeps weight ``rl_demo_weight``, small, so the TD signal
decides where to depart from the heuristic). Every ``validate_every`` episodes the greedy policy plays
``validation_episodes`` fixed episodes drawn from the training distribution (apart from the training
draws, never from held-out conditions) and the best RL checkpoint by mean recovered utility is the one
written (the imitation checkpoint is validated and logged too, but is eligible only with
``keep_imitation_checkpoint``, so the shipped weights are the RL stage's). The log records the heuristic's
utility on the same validation episodes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from pfec.common.sched.actions import N_ACTIONS, Action, SchedulerView
from pfec.common.sched.ddqn import (
    HIDDEN,
    MASK_AT,
    N_PARAMS,
    SCRATCH_SIZE,
    WEIGHTS_PATH,
    flatten_weights,
    greedy_action,
)
from pfec.common.sched.features import N_FEATURES, FeatureSink, write_features
from pfec.common.sched.policies import DeficitHeuristic, Scheme
from pfec.lab.sim.simulate import Handoff, SimConfig, prepare, run_once
from pfec.lab.train.episodes import (
    Episode,
    EpisodeRanges,
    Range,
    prefix_utility,
)
from pfec.lab.train.episodes import draw_episode as _draw
from pfec.lab.train.held_out import HELDOUT_SEED

LOG_PATH = Path(__file__).resolve().parents[2] / "docs" / "training" / "ddqn_train_log.jsonl"
_ACTIONS = tuple(Action)
_R = EpisodeRanges()


@dataclass(frozen=True)
class TrainConfig:
    episodes: int = 2500  # RL episodes after the imitation warm start
    heuristic_episodes: int = 60  # trajectories of the deficit heuristic that seed the replay memory
    seed: int = 0
    lr: float = 1e-4
    gamma: float = 1.0
    grad_clip: float = 5.0
    eps_start: float = 0.25
    eps_end: float = 0.05
    eps_decay_share: float = 0.8  # epsilon reaches eps_end after this share of the learning episodes
    learn_every: int = 16  # transitions between gradient updates
    target_sync: int = 500  # gradient updates between target-network copies
    batch_size: int = 64
    replay_size: int = 200_000
    # The training distribution (lab/train_episodes.EpisodeRanges).
    tokens: tuple[int, ...] = _R.tokens
    rates_mbps: tuple[float, ...] = _R.rates_mbps
    rtt_ms: Range = _R.rtt_ms
    rho: Range = _R.rho
    eps_g: Range = _R.eps_g
    eps_b: Range = _R.eps_b
    p_gb: Range = _R.p_gb
    p_bg: Range = _R.p_bg
    fifo_share: float = _R.fifo_share
    lambda_progress: float = 0.1
    lambda_deficit: float = 0.1
    lambda_window: float = 0.05
    init: str | None = None  # start from these weights (npz) instead of a random network
    pretrain_updates: int = 5000  # imitation updates on the heuristic's transitions (none without them)
    margin: float = 0.05  # large-margin loss: the demonstrated action's value above the others' by this
    demo_weight: float = 1.0  # weight of the margin loss during the imitation warm start
    rl_demo_weight: float = 0.1  # its weight during RL (on the demonstration transitions still replayed)
    validate_every: int = 100  # RL episodes between validations of the greedy policy (0: keep the last)
    validation_episodes: int = 64
    keep_imitation_checkpoint: bool = False  # may the imitation checkpoint be the one written?

    @property
    def ranges(self) -> EpisodeRanges:
        return EpisodeRanges(self.tokens, self.rates_mbps, self.rtt_ms, self.rho, self.eps_g, self.eps_b,
                             self.p_gb, self.p_bg, self.fifo_share)

    @property
    def warm_start(self) -> str:
        if self.init is not None:
            return f"weights {self.init}"
        if self.pretrain_updates > 0 and self.heuristic_episodes > 0:
            return (f"imitation of the deficit heuristic ({self.heuristic_episodes} episodes, "
                    f"{self.pretrain_updates} margin-loss updates), then RL")
        if self.heuristic_episodes > 0:
            return f"random network, RL with {self.heuristic_episodes} heuristic episodes in the replay"
        return "random network, RL only"

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("episodes", self.episodes >= 1, "give at least 1"),
            ("heuristic_episodes", self.heuristic_episodes >= 0, "give 0 or more"),
            ("seed", self.seed >= 0, "give a non-negative integer"),
            ("seed", self.seed != HELDOUT_SEED, f"{HELDOUT_SEED} is the held-out evaluation's seed"),
            ("lr", self.lr > 0 and math.isfinite(self.lr), "give a positive learning rate"),
            ("gamma", 0.0 < self.gamma <= 1.0, "give a discount in (0, 1]"),
            ("eps_start", 0.0 <= self.eps_start <= 1.0, "give an exploration rate in [0, 1]"),
            ("eps_end", 0.0 <= self.eps_end <= 1.0, "give an exploration rate in [0, 1]"),
            ("learn_every", self.learn_every >= 1, "give at least 1"),
            ("target_sync", self.target_sync >= 1, "give at least 1"),
            ("batch_size", self.batch_size >= 1, "give at least 1"),
            ("replay_size", self.replay_size >= self.batch_size, "give at least batch_size"),
            ("pretrain_updates", self.pretrain_updates >= 0, "give 0 or more"),
            ("margin", self.margin >= 0, "give a non-negative margin"),
            ("demo_weight", self.demo_weight >= 0, "give a non-negative weight"),
            ("rl_demo_weight", self.rl_demo_weight >= 0, "give a non-negative weight"),
            ("validate_every", self.validate_every >= 0, "give 0 (off) or more"),
            ("validation_episodes", self.validation_episodes >= 1, "give at least 1"),
        ]
        checks += [(name, False, fix) for name, fix in self.ranges.problems()]
        for name, ok, fix in checks:
            if not ok:
                raise ValueError(f"training {name}={getattr(self, name)!r} is invalid: {fix}")


def draw_episode(cfg: TrainConfig, rng: np.random.Generator) -> Episode:
    """One episode of the training distribution of ``cfg``."""
    return _draw(cfg.ranges, rng)


# ----------------------------------------------------------------------------- the network (torch)


class QNet(nn.Module):  # type: ignore[misc]
    """15-64-64-4 ReLU MLP, the torch twin of ``common.sched.ddqn``'s compiled forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(N_FEATURES, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, HIDDEN)
        self.l3 = nn.Linear(HIDDEN, N_ACTIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))

    def layers(self) -> dict[str, npt.NDArray[np.float32]]:
        out: dict[str, npt.NDArray[np.float32]] = {}
        for n, layer in enumerate((self.l1, self.l2, self.l3), start=1):
            out[f"w{n}"] = layer.weight.detach().numpy().astype(np.float32).copy()
            out[f"b{n}"] = layer.bias.detach().numpy().astype(np.float32).copy()
        return out

    def load_layers(self, layers: dict[str, npt.NDArray[np.floating]]) -> None:
        with torch.no_grad():
            for n, layer in enumerate((self.l1, self.l2, self.l3), start=1):
                layer.weight.copy_(torch.from_numpy(np.asarray(layers[f"w{n}"], dtype=np.float32)))
                layer.bias.copy_(torch.from_numpy(np.asarray(layers[f"b{n}"], dtype=np.float32)))


def save_weights(net: QNet, path: str | Path, meta: dict[str, Any]) -> None:
    layers = net.layers()
    assert flatten_weights(layers).shape == (N_PARAMS,)
    with open(path, "wb") as fh:
        arrays: dict[str, Any] = {**layers, "meta": np.array(json.dumps(meta, sort_keys=True))}
        np.savez(fh, **arrays)


# ----------------------------------------------------------------------------- replay memory


class Replay:
    """Ring buffer of (x, a, r, x', mask', done) in preallocated arrays."""

    def __init__(self, capacity: int) -> None:
        self.x = np.zeros((capacity, N_FEATURES), dtype=np.float32)
        self.a = np.zeros(capacity, dtype=np.int64)
        self.r = np.zeros(capacity, dtype=np.float32)
        self.x2 = np.zeros((capacity, N_FEATURES), dtype=np.float32)
        self.m = np.zeros((capacity, N_ACTIONS), dtype=np.bool_)  # allowed actions at x
        self.m2 = np.zeros((capacity, N_ACTIONS), dtype=np.bool_)
        self.done = np.zeros(capacity, dtype=np.float32)
        self.demo = np.zeros(capacity, dtype=np.bool_)  # the heuristic chose a (demonstration)
        self.capacity = capacity
        self.size = 0
        self._next = 0

    def add(self, x: npt.NDArray[np.float32], m: npt.NDArray[np.bool_], a: int, r: float,
            x2: npt.NDArray[np.float32] | None, m2: list[bool] | None, demo: bool) -> None:
        i = self._next
        self.x[i] = x
        self.m[i] = m
        self.a[i] = a
        self.r[i] = r
        self.demo[i] = demo
        if x2 is None or m2 is None:
            self.x2[i] = 0.0
            self.m2[i] = False
            self.done[i] = 1.0
        else:
            self.x2[i] = x2
            self.m2[i] = m2
            self.done[i] = 0.0
        self._next = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)


class Learner:
    """Double DQN: the online net picks the next action among the allowed ones, the target net values it."""

    def __init__(self, cfg: TrainConfig, replay: Replay, rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.replay = replay
        self.rng = rng
        self.online = QNet()
        if cfg.init is not None:
            with np.load(cfg.init) as data:
                self.online.load_layers({k: data[k] for k in ("w1", "b1", "w2", "b2", "w3", "b3")})
        self.target = QNet()
        self.target.load_state_dict(self.online.state_dict())
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=cfg.lr)
        self.updates = 0
        self.demo_weight = cfg.demo_weight  # the margin loss's weight in the current stage

    def params(self) -> npt.NDArray[np.float32]:
        return flatten_weights(self.online.layers())

    def update(self, demo_only: bool = False) -> float:
        rp, cfg = self.replay, self.cfg
        if demo_only:
            demos = np.flatnonzero(rp.demo[: rp.size])
            idx = demos[self.rng.integers(0, len(demos), cfg.batch_size)]
        else:
            idx = self.rng.integers(0, rp.size, cfg.batch_size)
        x = torch.from_numpy(rp.x[idx])
        a = torch.from_numpy(rp.a[idx])
        r = torch.from_numpy(rp.r[idx])
        x2 = torch.from_numpy(rp.x2[idx])
        m2 = torch.from_numpy(rp.m2[idx])
        done = torch.from_numpy(rp.done[idx])
        with torch.no_grad():
            next_online = self.online(x2).masked_fill(~m2, -1e9)
            next_action = next_online.argmax(dim=1, keepdim=True)
            next_value = self.target(x2).gather(1, next_action).squeeze(1)
            y = r + cfg.gamma * (1.0 - done) * next_value
        q_all = self.online(x)
        q = q_all.gather(1, a.unsqueeze(1)).squeeze(1)
        loss = nn.functional.smooth_l1_loss(q, y)
        demo = torch.from_numpy(rp.demo[idx])
        if self.demo_weight > 0 and bool(demo.any()):
            # max over allowed actions of Q(x, b) + margin * [b != a], minus Q(x, a): zero once the
            # demonstrated action leads every other allowed one by the margin.
            m = torch.from_numpy(rp.m[idx])
            bonus = torch.full_like(q_all, cfg.margin).scatter(1, a.unsqueeze(1), 0.0)
            best = (q_all + bonus).masked_fill(~m, -1e9).max(dim=1).values
            margin_loss = ((best - q) * demo.float()).sum() / demo.float().sum()
            loss = loss + self.demo_weight * margin_loss
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.online.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.updates += 1
        if self.updates % cfg.target_sync == 0:
            self.target.load_state_dict(self.online.state_dict())
        return float(loss.item())


# ----------------------------------------------------------------------------- episodes


class TrainingPolicy:
    """The policy the session asks during training: acts, and turns decisions into replay transitions."""

    name = "ddqn-train"
    sends_repairs = True

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.scratch = np.zeros(SCRATCH_SIZE, dtype=np.float32)
        self._cells = cast(FeatureSink, self.scratch.data)
        self._prev_x = np.zeros(N_FEATURES, dtype=np.float32)
        self._prev_mask = np.zeros(N_ACTIONS, dtype=np.bool_)
        self._prev_action = -1
        self._prev_value = 0.0  # J + F at the previous decision
        self.prefix_j: npt.NDArray[np.float64] = np.zeros(1)
        self.use_heuristic = False
        self.epsilon = 0.0
        self._heuristic = DeficitHeuristic()

    def start(self, prefix_j: npt.NDArray[np.float64], use_heuristic: bool, epsilon: float) -> None:
        self.prefix_j = prefix_j
        self.use_heuristic = use_heuristic
        self.epsilon = epsilon
        self._prev_action = -1

    def potential(self, view: SchedulerView) -> float:
        cfg = self.agent.cfg
        n = max(1, view.n_source)
        d = view.deficit_estimate
        return (cfg.lambda_progress * view.acked_prefix / n
                - cfg.lambda_deficit * d / max(1.0, d + view.repairs_left)
                - cfg.lambda_window * math.log1p(view.window_at_feedback) / math.log1p(n))

    def decide(self, view: SchedulerView) -> Action:
        write_features(view, self._cells)
        x = self.scratch[:N_FEATURES]
        value = float(self.prefix_j[min(view.acked_prefix, len(self.prefix_j) - 1)]) + self.potential(view)
        if self._prev_action >= 0:
            self.agent.record(self._prev_x, self._prev_mask, self._prev_action, value - self._prev_value, x,
                              view.mask, self.use_heuristic)
        action = self._choose(view)
        self._prev_x[:] = x
        self._prev_mask[:] = view.mask
        self._prev_action = action
        self._prev_value = value
        return _ACTIONS[action]

    def _choose(self, view: SchedulerView) -> int:
        if self.use_heuristic:
            return int(self._heuristic.decide(view))
        if self.agent.rng.random() < self.epsilon:
            allowed = [a for a in range(N_ACTIONS) if view.mask[a]]
            return allowed[int(self.agent.rng.integers(len(allowed)))]
        for a in range(N_ACTIONS):
            self._cells[MASK_AT + a] = view.mask[a]
        return int(greedy_action(self.agent.params, self.scratch))

    def finish(self, recovered_utility: float) -> None:
        """Terminal transition: the true utility at the deadline, F(terminal) = 0."""
        if self._prev_action >= 0:
            reward = recovered_utility - self._prev_value
            self.agent.record(self._prev_x, self._prev_mask, self._prev_action, reward, None, None,
                              self.use_heuristic)
        self._prev_action = -1

    def reset(self) -> None:
        pass


class Agent:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng([cfg.seed, 0x7EA1])
        torch.manual_seed(cfg.seed)
        self.replay = Replay(cfg.replay_size)
        self.learner = Learner(cfg, self.replay, np.random.default_rng([cfg.seed, 0xBA7C]))
        self.params = self.learner.params()
        self.learning = False
        self.recording = True  # off while validating: those episodes teach nothing
        self.transitions = 0
        self.losses: list[float] = []

    def record(self, x: npt.NDArray[np.float32], m: npt.NDArray[np.bool_], a: int, r: float,
               x2: npt.NDArray[np.float32] | None, m2: list[bool] | None, demo: bool) -> None:
        if not self.recording:
            return
        self.replay.add(x, m, a, r, x2, m2, demo)
        self.transitions += 1
        due = self.transitions % self.cfg.learn_every == 0
        if self.learning and due and self.replay.size >= self.cfg.batch_size:
            self.losses.append(self.learner.update())
            self.params = self.learner.params()


def epsilon_at(cfg: TrainConfig, episode: int) -> float:
    horizon = max(1.0, cfg.eps_decay_share * cfg.episodes)
    share = min(1.0, episode / horizon)
    return cfg.eps_start + (cfg.eps_end - cfg.eps_start) * share


def _run_episode(agent: Agent, policy: TrainingPolicy, ep: Episode, index: int, heuristic: bool,
                 epsilon: float) -> tuple[Handoff, float]:
    config = SimConfig(loss=ep.loss, rate_mbps=ep.rate_mbps, rtt_ms=ep.rtt_ms, rho=ep.rho, tokens=ep.tokens,
                       profile=ep.profile, seed=agent.cfg.seed)
    handoff = prepare(config)
    queue = handoff.queue(ep.order)
    policy.start(prefix_utility(handoff.plan, queue, handoff.block_utility), heuristic, epsilon)
    scheme = Scheme(policy.name, ep.order, lambda: policy, "training")  # type: ignore[arg-type]
    result = run_once(handoff, scheme, index, verify=False)
    policy.finish(result.recovered_utility)
    return handoff, result.recovered_utility


def _validate(agent: Agent, policy: TrainingPolicy, episodes: list[Episode], heuristic: bool) -> float:
    """Mean recovered utility of the greedy policy (or the heuristic) on fixed episodes; records nothing."""
    agent.recording = False
    try:
        return float(np.mean([
            _run_episode(agent, policy, ep, 10_000 + k, heuristic, 0.0)[1] for k, ep in enumerate(episodes)
        ]))
    finally:
        agent.recording = True


def train(cfg: TrainConfig, weights_path: Path = WEIGHTS_PATH, log_path: Path = LOG_PATH,
          progress: Callable[[int, int], None] | None = None, command: str | None = None) -> dict[str, Any]:
    """Warm-start by imitation (unless disabled), learn by RL for ``cfg.episodes`` with periodic
    validation, and write the best validated RL weights and the log."""
    torch.set_num_threads(1)  # deterministic given the seed (and fast enough for a 15-64-64-4 net)
    run = _TrainingRun(cfg, progress, command)
    with open(log_path, "w") as log:
        run.log = log
        run._log_line({"phase": "meta", "warm_start": cfg.warm_start, "command": command,
                       "config": asdict(cfg)})
        run.seed_with_heuristic()
        run.pretrain()
        run.learn()
        run.save(weights_path)
        run._log_line({"phase": "done", **run.result()})
    return run.summary(weights_path, log_path)


class _TrainingRun:
    """One run of ``train``: the agent, the episode streams, the JSON-lines log, the best validated net."""

    def __init__(self, cfg: TrainConfig, progress: Callable[[int, int], None] | None,
                 command: str | None) -> None:
        self.cfg = cfg
        self.command = command
        self.agent = Agent(cfg)
        self.policy = TrainingPolicy(self.agent)
        self.episode_rng = np.random.default_rng([cfg.seed, 0xE915])
        validation_rng = np.random.default_rng([cfg.seed, 0x5A11D])
        self.validation = [draw_episode(cfg, validation_rng) for _ in range(cfg.validation_episodes)]
        checks = -(-cfg.episodes // cfg.validate_every) if cfg.validate_every else 0
        self.total = cfg.heuristic_episodes + cfg.pretrain_updates // 500 + cfg.episodes + checks + 2
        self.done = 0
        self.progress = progress
        self.start = time.perf_counter()
        self.returns: list[float] = []
        self.log: IO[str] | None = None
        self.heuristic_validation = math.nan
        self.imitation_validation = math.nan
        self.best_utility = -math.inf
        self.best_layers: dict[str, npt.NDArray[np.float32]] = {}
        self.best_at = -1

    def _tick(self, steps: int = 1) -> None:
        self.done += steps
        if self.progress is not None:
            self.progress(min(self.done, self.total), self.total)

    def _log_line(self, entry: dict[str, Any]) -> None:
        assert self.log is not None
        self.log.write(json.dumps({**entry, "wall_s": round(time.perf_counter() - self.start, 2)}) + "\n")
        self.log.flush()

    def _validate(self, heuristic: bool) -> float:
        return _validate(self.agent, self.policy, self.validation, heuristic=heuristic)

    def seed_with_heuristic(self) -> None:
        """Validate the heuristic (the bar to beat), then fill the replay with its episodes."""
        agent = self.agent
        self.heuristic_validation = self._validate(heuristic=True)
        for i in range(self.cfg.heuristic_episodes):
            ep = draw_episode(self.cfg, self.episode_rng)
            before = agent.transitions
            _handoff, utility = _run_episode(agent, self.policy, ep, i, True, 0.0)
            self._log_line(_episode_entry(i, "heuristic", 0.0, utility, None, agent, before, ep))
            self._tick()

    def pretrain(self) -> None:
        """Imitation updates on the heuristic's transitions only; then the first validation."""
        agent = self.agent
        n_updates = self.cfg.pretrain_updates if self.cfg.heuristic_episodes > 0 else 0  # nothing to imitate
        for k in range(n_updates):
            loss = agent.learner.update()
            if (k + 1) % 500 == 0:
                updates = agent.learner.updates
                self._log_line({"phase": "pretrain", "updates": updates, "loss": round(loss, 6)})
                self._tick()
        agent.params = agent.learner.params()
        self.imitation_validation = self._validate(heuristic=False)
        self._log_line({"phase": "validate", "episode": 0, "utility": round(self.imitation_validation, 6),
                        "heuristic": round(self.heuristic_validation, 6), "stage": "imitation"})
        if self.cfg.keep_imitation_checkpoint:
            self._keep(self.imitation_validation, 0)
        self._tick()

    def learn(self) -> None:
        """The agent's own epsilon-greedy episodes, validated every ``cfg.validate_every``; the best kept."""
        cfg, agent = self.cfg, self.agent
        agent.learner.demo_weight = cfg.rl_demo_weight
        for j in range(cfg.episodes):
            i = cfg.heuristic_episodes + j
            agent.learning = True
            epsilon = epsilon_at(cfg, j)
            ep = draw_episode(cfg, self.episode_rng)
            agent.losses.clear()
            before = agent.transitions
            _handoff, utility = _run_episode(agent, self.policy, ep, i, False, epsilon)
            self.returns.append(utility)
            loss_mean = float(np.mean(agent.losses)) if agent.losses else None
            self._log_line(_episode_entry(i, "ddqn", epsilon, utility, loss_mean, agent, before, ep))
            self._tick()
            last = j + 1 == cfg.episodes
            if cfg.validate_every and ((j + 1) % cfg.validate_every == 0 or last):
                self._checkpoint(j + 1)
        if not cfg.validate_every:
            self.best_layers, self.best_at = agent.learner.online.layers(), cfg.episodes

    def _keep(self, utility: float, episode: int) -> None:
        if utility > self.best_utility:
            self.best_utility, self.best_at = utility, episode
            self.best_layers = self.agent.learner.online.layers()

    def _checkpoint(self, episode: int) -> None:
        self.agent.learning = False
        utility = self._validate(heuristic=False)
        self._log_line({"phase": "validate", "episode": episode, "utility": round(utility, 6),
                        "heuristic": round(self.heuristic_validation, 6), "stage": "rl"})
        self._tick()
        self._keep(utility, episode)

    def result(self) -> dict[str, Any]:
        return {"warm_start": self.cfg.warm_start, "command": self.command,
                "transitions": self.agent.transitions, "updates": self.agent.learner.updates,
                "checkpoint_episode": self.best_at, "validation_utility": round(self.best_utility, 6),
                "validation_imitation": round(self.imitation_validation, 6),
                "validation_heuristic": round(self.heuristic_validation, 6),
                "wall_s": round(time.perf_counter() - self.start, 1)}

    def save(self, weights_path: Path) -> None:
        meta = {"config": asdict(self.cfg), "features": "common.sched.features v2 (log deficit)",
                **self.result()}
        net = QNet()
        net.load_layers(cast(dict[str, npt.NDArray[np.floating]], self.best_layers))
        save_weights(net, weights_path, meta)

    def summary(self, weights_path: Path, log_path: Path) -> dict[str, Any]:
        tail = self.returns[-max(1, len(self.returns) // 10):]
        return {
            "weights": str(weights_path), "log": str(log_path),
            "episodes": self.cfg.heuristic_episodes + self.cfg.episodes, **self.result(),
            "mean_return_last_10pct": float(np.mean(tail)) if tail else None,
        }


def _episode_entry(i: int, phase: str, epsilon: float, utility: float, loss: float | None, agent: Agent,
                   before: int, ep: Episode) -> dict[str, Any]:
    return {
        "episode": i, "phase": phase, "epsilon": round(epsilon, 4), "return": round(utility, 6),
        "loss": round(loss, 6) if loss is not None else None,
        "transitions": agent.transitions - before, "updates": agent.learner.updates,
        "tokens": ep.tokens, "rate_mbps": ep.rate_mbps, "rtt_ms": round(ep.rtt_ms, 3),
        "rho": round(ep.rho, 4), "order": ep.order,
        "ge": [round(v, 5) for v in (ep.loss.eps_g, ep.loss.eps_b, ep.loss.p_gb, ep.loss.p_bg)],
    }
