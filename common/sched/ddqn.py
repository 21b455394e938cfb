"""Double-DQN repair scheduler inference without torch (paper IV-D): a 15-64-64-4 ReLU MLP in float32.

Sans-IO. The trained weights (``common/sched/ddqn_weights.npz``, written by ``pfec train``: lab/train/ddqn.py)
are flattened once into one float32 parameter vector in torch's ``Linear`` layout (weight [out, in], then
bias, layer by layer: 5,444 numbers). A decision writes the 15 features and the 4 action masks into one
preallocated scratch vector and makes one compiled call that runs the network and returns the greedy
allowed action; masked actions are never chosen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pfec.common.codec.gf256 import entry_point
from pfec.common.codec.jit import njit_cached_with
from pfec.common.sched.actions import N_ACTIONS, Action, SchedulerView
from pfec.common.sched.features import N_FEATURES, WINDOW_SCALE

_LOG_WINDOW = math.log1p(WINDOW_SCALE)

HIDDEN = 64
LAYER_SHAPES: tuple[tuple[int, int], ...] = ((HIDDEN, N_FEATURES), (HIDDEN, HIDDEN), (N_ACTIONS, HIDDEN))
N_PARAMS = sum(o * i + o for o, i in LAYER_SHAPES)  # 5,444
WEIGHTS_PATH = Path(__file__).with_name("ddqn_weights.npz")
WEIGHT_KEYS = ("w1", "b1", "w2", "b2", "w3", "b3")

# Scratch layout: features | masks (1.0 allowed) | hidden 1 | hidden 2.
MASK_AT = N_FEATURES
H1_AT = MASK_AT + N_ACTIONS
H2_AT = H1_AT + HIDDEN
SCRATCH_SIZE = H2_AT + HIDDEN
_ACTIONS = tuple(Action)

Float32Array = npt.NDArray[np.float32]


def flatten_weights(layers: dict[str, npt.NDArray[np.floating]]) -> Float32Array:
    """w1, b1, w2, b2, w3, b3 (torch Linear layout) -> one float32 vector of N_PARAMS."""
    parts = []
    for n, (out_dim, in_dim) in enumerate(LAYER_SHAPES, start=1):
        w = np.asarray(layers[f"w{n}"], dtype=np.float32)
        b = np.asarray(layers[f"b{n}"], dtype=np.float32)
        if w.shape != (out_dim, in_dim) or b.shape != (out_dim,):
            raise ValueError(
                f"layer {n} has weight {w.shape} and bias {b.shape}; expected ({out_dim}, {in_dim}) and "
                f"({out_dim},) for the 15-64-64-4 network"
            )
        parts += [w.ravel(), b]
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def load_weights(path: str | Path = WEIGHTS_PATH) -> Float32Array:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"DDQN weights {str(p)!r} do not exist; train them with `pfec train`")
    with np.load(p) as data:
        missing = [k for k in WEIGHT_KEYS if k not in data]
        if missing:
            raise ValueError(f"DDQN weights {str(p)!r} lack arrays {missing}; retrain with `pfec train`")
        return flatten_weights({k: data[k] for k in WEIGHT_KEYS})


@njit_cached_with(boundscheck=False, fastmath=True, inline="always")
def _dense(params: Float32Array, at: int, src: Float32Array, src_at: int, n_in: int,
           dst: Float32Array, dst_at: int, n_out: int, relu: bool) -> int:
    """dst[dst_at:+n_out] = (relu of) W @ src[src_at:+n_in] + b; returns the offset past this layer."""
    bias_at = at + n_out * n_in
    for j in range(n_out):
        acc = np.float32(0.0)
        row = at + j * n_in
        for i in range(n_in):
            acc += params[row + i] * src[src_at + i]
        acc += params[bias_at + j]
        dst[dst_at + j] = max(acc, np.float32(0.0)) if relu else acc
    return bias_at + n_out


@njit_cached_with(boundscheck=False, fastmath=True)
def q_values(params: Float32Array, scratch: Float32Array, q: Float32Array) -> None:
    """Q(x, .) of the features in scratch[:N_FEATURES] into q (float32[N_ACTIONS])."""
    at = _dense(params, 0, scratch, 0, N_FEATURES, scratch, H1_AT, HIDDEN, True)
    at = _dense(params, at, scratch, H1_AT, HIDDEN, scratch, H2_AT, HIDDEN, True)
    _dense(params, at, scratch, H2_AT, HIDDEN, q, 0, N_ACTIONS, False)


@njit_cached_with(boundscheck=False, fastmath=True)
def greedy_action(params: Float32Array, scratch: Float32Array) -> int:
    """argmax of Q over the allowed actions (scratch[MASK_AT + a] > 0); -1 when none is allowed.

    Ties go to the lowest action index, as torch.argmax does.
    """
    q = np.empty(N_ACTIONS, dtype=np.float32)
    q_values(params, scratch, q)
    best = -1
    for a in range(N_ACTIONS):
        if scratch[MASK_AT + a] > 0 and (best < 0 or q[a] > q[best]):
            best = a
    return best


@njit_cached_with(boundscheck=False, inline="always")
def _clip01(x: float) -> float:
    return 0.0 if x < 0.0 else (1.0 if x > 1.0 else x)


@njit_cached_with(boundscheck=False)
def write_features_compiled(
    scratch: Float32Array,
    repairs_left: int,
    repair_budget: int,
    slots_left: int,
    slots_total: int,
    n_source: int,
    sources_sent: int,
    deficit: float,
    loss: float,
    burst: float,
    window: int,
    window_fb: int,
    staleness: float,
    rtt: float,
    progress: float,
    utility: float,
    upcoming: float,
    effectiveness: float,
) -> None:
    """common.sched.features.write_features, compiled (same float64 arithmetic, no fastmath, float32 store):
    the decision path computes the features here instead of fifteen Python stores."""
    total = max(1, slots_total)
    sources_left = n_source - sources_sent
    stale_rtts = staleness / rtt if rtt > 0.0 else 0.0
    scratch[0] = _clip01(repairs_left / max(1, repair_budget))
    scratch[1] = _clip01(slots_left / total)
    scratch[2] = sources_left / max(1, sources_left + slots_left)
    slack = (slots_left - sources_left - deficit) / total
    scratch[3] = -1.0 if slack < -1.0 else (1.0 if slack > 1.0 else slack)
    scratch[4] = _clip01(loss)
    scratch[5] = _clip01(1.0 - 1.0 / max(1.0, burst))
    scratch[6] = _clip01(math.log1p(deficit) / _LOG_WINDOW)
    scratch[7] = deficit / max(1.0, deficit + repairs_left)
    scratch[8] = _clip01(window / WINDOW_SCALE)
    scratch[9] = _clip01(window_fb / WINDOW_SCALE)
    scratch[10] = stale_rtts / (1.0 + stale_rtts)
    scratch[11] = _clip01(progress)
    scratch[12] = _clip01(utility)
    scratch[13] = _clip01(upcoming)
    scratch[14] = _clip01(effectiveness)


@njit_cached_with(boundscheck=False)
def decide_compiled(
    params: Float32Array,
    scratch: Float32Array,
    repairs_left: int,
    repair_budget: int,
    slots_left: int,
    slots_total: int,
    n_source: int,
    sources_sent: int,
    deficit: float,
    loss: float,
    burst: float,
    window: int,
    window_fb: int,
    staleness: float,
    rtt: float,
    progress: float,
    utility: float,
    upcoming: float,
    effectiveness: float,
    m0: bool,
    m1: bool,
    m2: bool,
    m3: bool,
) -> int:
    """The whole decision in one call: features, masks, network, greedy allowed action (-1: none)."""
    write_features_compiled(
        scratch, repairs_left, repair_budget, slots_left, slots_total, n_source, sources_sent, deficit,
        loss, burst, window, window_fb, staleness, rtt, progress, utility, upcoming, effectiveness,
    )
    scratch[MASK_AT] = 1.0 if m0 else 0.0
    scratch[MASK_AT + 1] = 1.0 if m1 else 0.0
    scratch[MASK_AT + 2] = 1.0 if m2 else 0.0
    scratch[MASK_AT + 3] = 1.0 if m3 else 0.0
    return greedy_action(params, scratch)


def _bind_decide(params: Float32Array, scratch: Float32Array) -> Callable[..., int]:
    """decide_compiled through its bound entry point (numba's dispatch would cost as much as the net)."""
    example: tuple[Any, ...] = (params, scratch, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 1.0, 0, 0, 0.0, 0.0, 0.0,
                                0.0, 0.0, 0.0, True, True, True, True)
    return entry_point(decide_compiled, *example)


class DDQNPolicy:
    """The greedy policy of a trained Q-network (schemes ``rl-fec`` and ``priorityfec``)."""

    name = "ddqn"
    sends_repairs = True

    def __init__(self, params: Float32Array | None = None) -> None:
        self.params = _default_params() if params is None else params
        if self.params.shape != (N_PARAMS,) or self.params.dtype != np.float32:
            got = f"{self.params.dtype}{self.params.shape}"
            raise ValueError(f"DDQN params must be float32[{N_PARAMS}], got {got}")
        self.params = np.ascontiguousarray(self.params)
        self.scratch = np.zeros(SCRATCH_SIZE, dtype=np.float32)
        self._decide = _bind_decide(self.params, self.scratch)

    def decide(self, view: SchedulerView) -> Action:
        # The view's fields have the kernel's types (ints, floats, bools): no conversions on this path.
        mask = view.mask
        action = self._decide(
            self.params,
            self.scratch,
            view.repairs_left,
            view.repair_budget,
            view.slots_left,
            view.slots_total,
            view.n_source,
            view.sources_sent,
            view.deficit_estimate,
            view.loss_estimate,
            view.burst_estimate,
            view.window_size,
            view.window_at_feedback,
            view.ack_staleness,
            view.rtt_estimate,
            view.block_progress,
            view.block_utility,
            view.upcoming_utility,
            view.repair_effectiveness,
            mask[0],
            mask[1],
            mask[2],
            mask[3],
        )
        if action < 0:
            raise ValueError("no action is allowed; the session must not ask the policy")
        return _ACTIONS[action]

    def reset(self) -> None:
        pass


_DEFAULT: list[Float32Array] = []


def _default_params() -> Float32Array:
    """The committed weights, loaded once per process."""
    if not _DEFAULT:
        _DEFAULT.append(load_weights())
    return _DEFAULT[0]


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels before a timed run."""
    greedy_action(np.zeros(N_PARAMS, dtype=np.float32), np.zeros(SCRATCH_SIZE, dtype=np.float32))
    _bind_decide(np.zeros(N_PARAMS, dtype=np.float32), np.zeros(SCRATCH_SIZE, dtype=np.float32))
