"""Break-even planner: should the receiver get its KV over the link, compute it, or both?

A handoff is only worth its bytes when it beats recomputing (DESIGN.md, "Bytes are the budget"). Before a
handoff the sender predicts the time to first token (TTFT) of three kinds of option and picks the fastest
that keeps a fidelity floor:

- ``local``: the receiver prefills the whole context itself (exact).
- ``handoff``: the whole cache streams at one precision level: handshake + one-way delay + serialisation
  (framing and FEC overhead included) + rebuild (dequantisation) on the receiver.
- ``split``: the receiver prefills the front [0, m) while the sender streams the back [m, N); a prefix's
  KV does not depend on what follows, so the two halves join exactly. The meeting point m equalises the
  two sides' finishing times; TTFT = max(both) + rebuilding the back.

Every option ends with the receiver's first decode step. The clock starts when the sender decides, so
every option pays the one-way delay of telling the receiver (the token ids are small next to KV).

Times come from plain numbers: the receiver's prefill curve t(N) = a + bN + cN^2 (:mod:`.prefill`;
measured by ``common/model/speed.py`` on the node, the default model's below, or a preset of
:mod:`.breakeven_scan`), its per-token decode time, the link's rate, RTT and expected loss. Sans-IO: no
torch, no clock; each default says where its number comes from. Model presets and scans along the
context length (where the choice switches) are :mod:`.breakeven_scan`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

import numpy as np

from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, FRAGMENT_ID_SIZE, KVGeometry
from pfec.common.plan.pieces import PieceLayout, mix_bytes_per_token
from pfec.common.plan.prefill import FRONT_CHUNK_TOKENS, PrefillCurve, finite_nonneg, front_chunk_end
from pfec.common.wire.messages import DEFAULT_SYMBOL_SIZE, OVERHEAD, SOURCE_ID_SIZE

Mode = Literal["local", "handoff", "split"]
MODES: Final[tuple[Mode, ...]] = ("local", "handoff", "split")  # tie-break order: simplest first
MB: Final = 1_000_000


# --- Precision levels -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrecisionLevel:
    """One way to ship the cache: its size relative to a bf16 cache and the fidelity it keeps.

    ``bf16_ratio`` is bytes per token over the geometry's bf16 bytes per token (None: the geometry's own
    dtype, i.e. native). ``mean_kl`` orders fidelity (lower keeps more); ``rebuild_s_per_mb`` is the
    receiver's rebuild/dequantisation time per MB of bf16-equivalent KV.
    """

    name: str
    bf16_ratio: float | None
    mean_kl: float
    agreement: float
    rebuild_s_per_mb: float

    def __post_init__(self) -> None:
        if self.bf16_ratio is not None and not (math.isfinite(self.bf16_ratio) and self.bf16_ratio > 0):
            raise ValueError(f"precision {self.name!r}: bf16_ratio must be finite and > 0")
        finite_nonneg(f"precision {self.name!r} mean_kl", self.mean_kl)
        finite_nonneg(f"precision {self.name!r} rebuild_s_per_mb", self.rebuild_s_per_mb)
        if not 0 <= self.agreement <= 1:
            raise ValueError(f"precision {self.name!r}: agreement must lie in [0, 1]")

    def bytes_per_token(self, geometry: KVGeometry) -> int:
        """KV bytes per token at this level for ``geometry`` (scales with layers x KV heads x head dim)."""
        if self.bf16_ratio is None:
            return geometry.bytes_per_token
        bf16 = 2 * geometry.n_layers * geometry.n_kv_heads * geometry.head_dim * 2
        return round(self.bf16_ratio * bf16)


# Rebuilding a native cache (bytes -> tensors, masks) on this machine: 2.2 ms per MB (median of 5), measured
# with llm.rebuild_from_rows on the default model, 1024 tokens (23.6 MB), 1 torch thread, 2-core x86 VM,
# 2026-12-01 (1.4 ms/MB with 2 threads).
NATIVE_REBUILD_S_PER_MB: Final = 0.0022

# DEFAULTS from issue 13's measurements on the default model (SmolLM2-135M, 12 needle-QA prompts at ~1.8k
# tokens, quantise -> dequantise of the whole cache, greedy 24 tokens vs the full-KV answer): mean KL and
# agreement. Rebuild adds the measured whole-cache quantise+dequantise time per bf16 MB on one thread (int8
# 2.3 ms, int4 3.7 ms; the int8/int4 half-and-half mix their mean; int2 assumed as int4): an upper bound
# for dequantising alone. Bytes per token are the stream's own (``pieces.mix_bytes_per_token``: each
# block's ladder from its int2 base up, minima and steps included): int8 13,690, int8-int4 10,810, int4
# 7,930, int2 5,050 at the default geometry, native 23,040. The table issue 13 measured on plain quantised
# caches (int8 11,880, int8-int4 9,910) under-predicted int8 streams by 15% (pfec bench breakeven: 17.3 MB
# sent for 1,223 tokens where 15.0 MB were predicted).
DEFAULT_BF16_BYTES_PER_TOKEN: Final = 23_040
BF16_PER_TOKEN: Final = DEFAULT_BF16_BYTES_PER_TOKEN
REBUILD: Final = NATIVE_REBUILD_S_PER_MB
_RATIO_LAYOUT: Final = PieceLayout(DEFAULT_GEOMETRY, 4096)  # the ratio moves < 0.1% from 512 to 8k tokens


def _stream_ratio(mix: str) -> float:
    """A quantised mix's stream bytes per token over bf16's (it scales with the geometry's KV size)."""
    return mix_bytes_per_token(_RATIO_LAYOUT, mix) / _RATIO_LAYOUT.geometry.bytes_per_token


DEFAULT_PRECISION_LEVELS: Final[tuple[PrecisionLevel, ...]] = (
    PrecisionLevel("native", None, 0.0, 1.0, REBUILD),
    PrecisionLevel("int8", _stream_ratio("int8"), 0.0001, 1.0, REBUILD + 0.0023),
    PrecisionLevel("int8-int4", _stream_ratio("int8-int4"), 0.0004, 1.0, REBUILD + 0.0030),
    PrecisionLevel("int4", _stream_ratio("int4"), 0.0036, 0.976, REBUILD + 0.0037),
    PrecisionLevel("int2", _stream_ratio("int2"), 0.304, 0.882, REBUILD + 0.0037),
)
# The default fidelity floor: int8. On the 32-prompt fidelity set (docs/RESULTS.md, "Precision fidelity",
# where the whole stream arrives: rho 0.8 and 1) int8's answers equal the full-KV answer in 31 of 32
# (96.9%); int8-int4 (top half int8, the rest int4) in 28 (87.5%), int4 in 29 (90.6%).
DEFAULT_FLOOR: Final = "int8"
# A stream must be predicted this share faster than local prefill to be chosen over it: the predictions
# err by tens of percent (the default demo measured its handoff 32% slower than predicted), and local
# prefill is exact.
LOCAL_MARGIN: Final = 0.2


def keeps_floor(name: str, floor: str = DEFAULT_FLOOR,
                levels: Sequence[PrecisionLevel] = DEFAULT_PRECISION_LEVELS) -> bool:
    """Whether level ``name`` keeps the fidelity floor: its mean KL is at most the floor level's."""
    return level_named(name, levels).mean_kl <= level_named(floor, levels).mean_kl


def beats_local(ttft_s: float, local_ttft_s: float, local_margin: float = LOCAL_MARGIN) -> bool:
    """Whether a stream's TTFT beats local prefill's by ``local_margin`` (a share): a planner candidate."""
    return ttft_s < (1 - local_margin) * local_ttft_s


def level_named(name: str, levels: Sequence[PrecisionLevel] = DEFAULT_PRECISION_LEVELS) -> PrecisionLevel:
    """The level called ``name``; an unknown name is refused with the known ones."""
    for level in levels:
        if level.name == name:
            return level
    raise ValueError(f"unknown precision {name!r}: known levels are {', '.join(x.name for x in levels)}")


# --- Link and receiver ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkModel:
    """The path between the nodes as the planner sees it.

    ``loss`` is the expected share of sent bytes lost; an erasure code must send 1 / (1 - loss) times the
    data. ``handshake_rtts`` counts round trips before the bulk flows (0 when data follows the OFFER).
    Each datagram carries ``symbol_size - 4`` KV bytes (a fragment id) and costs the symbol plus the source
    id, header and AEAD tag on the link. ``split_rate_bps``: what the path delivers while the receiver
    also computes a split's front (where its receive path, not the link, bounds the stream, the front
    takes CPU from it); None: ``rate_bps``.
    """

    rate_bps: float
    rtt_s: float
    loss: float = 0.0
    handshake_rtts: float = 1.0
    symbol_size: int = DEFAULT_SYMBOL_SIZE
    split_rate_bps: float | None = None

    def __post_init__(self) -> None:
        for rate in (self.rate_bps, self.split_rate_bps):
            if rate is not None and (math.isnan(rate) or rate <= 0):
                raise ValueError(f"link rate must be > 0 bit/s, got {rate!r}")
        finite_nonneg("RTT", self.rtt_s)
        if not (math.isfinite(self.loss) and 0 <= self.loss < 1):
            raise ValueError(f"loss must lie in [0, 1), got {self.loss!r}")
        finite_nonneg("handshake_rtts", self.handshake_rtts)
        if not isinstance(self.symbol_size, int) or self.symbol_size <= FRAGMENT_ID_SIZE:
            raise ValueError(f"symbol size must be an int > {FRAGMENT_ID_SIZE}, got {self.symbol_size!r}")

    @property
    def owd_s(self) -> float:
        return self.rtt_s / 2

    @property
    def handshake_s(self) -> float:
        return self.handshake_rtts * self.rtt_s

    @property
    def wire_per_kv_byte(self) -> float:
        """Link bytes per delivered KV byte: framing x FEC overhead."""
        payload = self.symbol_size - FRAGMENT_ID_SIZE
        datagram = self.symbol_size + SOURCE_ID_SIZE + OVERHEAD
        return datagram / payload / (1.0 - self.loss)

    def split_link(self) -> LinkModel:
        """The link a split's back streams over (``split_rate_bps``)."""
        if self.split_rate_bps is None:
            return self
        return LinkModel(self.split_rate_bps, self.rtt_s, self.loss, self.handshake_rtts, self.symbol_size)

    def wire_bytes(self, kv_bytes: float) -> float:
        return kv_bytes * self.wire_per_kv_byte

    def serialisation_s(self, kv_bytes: float) -> float:
        """Seconds to put ``kv_bytes`` of KV (plus framing and repair) on the link."""
        return self.wire_bytes(kv_bytes) * 8 / self.rate_bps


@dataclass(frozen=True, slots=True)
class ReceiverModel:
    """The receiver's compute: prefill curve, one decode step, fixed cost of joining front and back.

    ``rebuild_scale`` multiplies the levels' rebuild times, which were measured on this 2-core CPU (1.0);
    a GPU receiver rebuilds far faster (see the 7B preset). ``question_tokens``: what the receiver
    prefills after the context before its first token (the handoff's question; one more forward call
    over the whole cache, whichever way the context's KV got there). ``front_scale`` multiplies a split's
    front: it shares the receiver's CPU with the stream it meets, so it runs slower than ``prefill`` (the
    receiver's unloaded speed) by what past splits over the same path measured (1.0: none did).

    What the receiver measured on itself (``common/model/speed.py``, stated in its ACCEPT; None or 0: the
    constants above): ``rebuild_s_per_token`` (native, int8, int4, int2: dequantise and place one context
    token of every layer), ``question_fit`` (a, per question token, per cached token: the question's
    masked forward over a cache of N tokens, copy included), ``decode_s_per_token`` (the first decode
    step grows by this per cached token over ``decode_s``) and ``datagram_s`` (the receive path's CPU per
    datagram: a split's front shares its core with it, ``stream_factor``). ``defaulted`` names the stated
    numbers that were missing or absurd and replaced by the conservative defaults.
    """

    prefill: PrefillCurve
    decode_s: float
    join_s: float = 0.0
    rebuild_scale: float = 1.0
    question_tokens: int = 0
    front_scale: float = 1.0
    rebuild_s_per_token: tuple[float, float, float, float] | None = None
    question_fit: tuple[float, float, float] | None = None
    decode_s_per_token: float = 0.0
    datagram_s: float | None = None
    defaulted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        finite_nonneg("decode_s", self.decode_s)
        finite_nonneg("join_s", self.join_s)
        finite_nonneg("rebuild_scale", self.rebuild_scale)
        finite_nonneg("decode_s_per_token", self.decode_s_per_token)
        for name in ("rebuild_s_per_token", "question_fit"):
            for value in getattr(self, name) or ():
                finite_nonneg(name, value)
        if self.datagram_s is not None:
            finite_nonneg("datagram_s", self.datagram_s)
        if not (math.isfinite(self.front_scale) and self.front_scale > 0):
            raise ValueError(f"front_scale must be finite and > 0, got {self.front_scale!r}")
        if not isinstance(self.question_tokens, int) or self.question_tokens < 0:
            raise ValueError(f"question_tokens must be an int >= 0, got {self.question_tokens!r}")

    def question_s(self, n_tokens: int) -> float:
        """The question's forward call over a cache of ``n_tokens`` (0 without a question): as measured
        (``question_fit``), else the prefill curve's chunk."""
        if self.question_tokens == 0:
            return 0.0
        if self.question_fit is not None:
            a, per_question, per_cached = self.question_fit
            return a + per_question * self.question_tokens + per_cached * n_tokens
        return self.prefill.chunk_seconds(n_tokens, n_tokens + self.question_tokens)

    def decode_at(self, n_tokens: int) -> float:
        """One decode step over a cache of ``n_tokens``."""
        return self.decode_s + self.decode_s_per_token * n_tokens

    def stream_factor(self, link: LinkModel) -> float:
        """How much slower a split's front runs beside its stream: the receive path takes ``datagram_s``
        per datagram of the core the front runs on, at the datagrams per second ``link`` delivers (a
        share u, at most ``MAX_STREAM_SHARE``): 1 / (1 - u); 1.0 where nothing was measured."""
        if self.datagram_s is None:
            return 1.0
        datagrams_per_s = link.rate_bps / 8 / (link.symbol_size + SOURCE_ID_SIZE + OVERHEAD)
        return 1.0 / (1.0 - min(MAX_STREAM_SHARE, self.datagram_s * datagrams_per_s))

    def beside_stream(self, link: LinkModel) -> ReceiverModel:
        """This receiver with the stream's slowdown (``stream_factor``) in its ``front_scale``."""
        if self.datagram_s is None:
            return self
        return replace(self, front_scale=self.front_scale * self.stream_factor(link), datagram_s=None)

    def front_s(self, m: int) -> float:
        """A split's front [0, m) as the receiver computes it beside the stream: chunks of
        ``FRONT_CHUNK_TOKENS``, each a forward call of its own (``front_chunk_end``), ``front_scale``
        slower than unloaded."""
        return self.front_scale * self.unloaded_front_s(m)

    def unloaded_front_s(self, m: int) -> float:
        """The same chunks at the receiver's unloaded speed (``prefill``)."""
        seconds, done = 0.0, 0
        while done < m:
            end = front_chunk_end(done, m, m)
            seconds += self.prefill.chunk_seconds(done, end)
            done = end
        return seconds


#: The largest share of a core the receive path is taken to claim from a split's front (a front 5x slower).
MAX_STREAM_SHARE: Final = 0.8
#: The levels a receiver measures its rebuild at (``ReceiverModel.rebuild_s_per_token``), in its order; a
#: mix of two takes their mean.
MEASURED_REBUILD_LEVELS: Final = ("native", "int8", "int4", "int2")
MIXED_REBUILD_LEVELS: Final = {"int8-int4": ("int8", "int4")}


# --- The default receiver ---------------------------------------------------------------------------------

# Measured here with common/model/speed.measure_prefill_speed: default model (SmolLM2-135M-Instruct), CPU,
# fp32 compute, 2 torch threads (the daemons' default on this machine), fastest of 2 runs at 256 / 1024 /
# 2048 / 4096 tokens after one warm-up: 0.388 / 1.790 / 4.372 / 14.19 s; one decode step at 4k: 81 ms.
# 2-core x86 VM, 2026-12-01. The start-up default lengths (128/512/1024) fit c poorly (runs gave c from
# 3e-7 to 9e-7): this wider fit is the one to extrapolate to 8k. 1 thread: 0.38 / 1.49 / 3.46 s at
# 128 / 512 / 1024 tokens.
DEFAULT_MODEL_PREFILL: Final = PrefillCurve(a=0.2193, b=7.337e-4, c=6.525e-7)
DEFAULT_MODEL_DECODE_S: Final = 0.081


# --- The planner ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Option:
    """One way to get the receiver its first token, with its predicted TTFT and what it costs."""

    mode: Mode
    precision: str  # "exact" for local prefill
    ttft_s: float
    kv_bytes: int  # KV bytes delivered over the link
    wire_bytes: int  # link bytes incl. framing and FEC repair
    keeps_floor: bool
    meeting_token: int | None = None  # split: the receiver computes [0, m), the link carries [m, N)
    parts: dict[str, float] = field(default_factory=dict)  # the TTFT's terms, s

    @property
    def label(self) -> str:
        return self.mode if self.mode == "local" else f"{self.mode}:{self.precision}"

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode, "precision": self.precision, "ttft_s": self.ttft_s, "kv_bytes": self.kv_bytes,
            "wire_bytes": self.wire_bytes, "keeps_floor": self.keeps_floor,
            "meeting_token": self.meeting_token, "parts": dict(self.parts),
        }


@dataclass(frozen=True, slots=True)
class Plan:
    """Every option (including those below the fidelity floor, never chosen) and the choice."""

    n_tokens: int
    floor: str
    options: tuple[Option, ...]
    choice: Option

    def option(self, mode: Mode, precision: str | None = None) -> Option:
        for opt in self.options:
            if opt.mode == mode and (precision is None or opt.precision == precision):
                return opt
        raise KeyError(f"no option {mode}:{precision}")

    def to_dict(self) -> dict[str, object]:
        return {"n_tokens": self.n_tokens, "floor": self.floor, "choice": self.choice.to_dict(),
                "options": [o.to_dict() for o in self.options]}


def _check_tokens(n_tokens: int) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int | np.integer) or n_tokens <= 0:
        raise ValueError(f"token count must be a positive integer, got {n_tokens!r}")


def local_option(n_tokens: int, link: LinkModel, receiver: ReceiverModel) -> Option:
    """The receiver prefills everything itself once told to (one-way delay): the context and the
    question in one pass."""
    prefill = receiver.prefill.seconds(n_tokens + receiver.question_tokens)
    parts = {"owd_s": link.owd_s, "prefill_s": prefill,
             "decode_s": receiver.decode_at(n_tokens + receiver.question_tokens)}
    return Option("local", "exact", sum(parts.values()), 0, 0, True, None, parts)


def handoff_option(n_tokens: int, geometry: KVGeometry, level: PrecisionLevel, link: LinkModel,
                   receiver: ReceiverModel, keeps_floor: bool) -> Option:
    """The whole cache streams at ``level``: handshake + one-way delay + serialisation + rebuild, then
    the question's forward call and a decode step."""
    kv = n_tokens * level.bytes_per_token(geometry)
    rebuild = _rebuild_s(n_tokens, geometry, level, receiver)
    if _rebuilds_live(level, receiver):  # placed as it arrives: what the stream outpaces, or its last period
        rebuild = _left_at_ready(rebuild, link.serialisation_s(kv))
    parts = {
        "handshake_s": link.handshake_s, "owd_s": link.owd_s, "serialisation_s": link.serialisation_s(kv),
        "rebuild_s": rebuild,
        "question_s": receiver.question_s(n_tokens),
        "decode_s": receiver.decode_at(n_tokens + receiver.question_tokens),
    }
    return Option("handoff", level.name, sum(parts.values()), kv, math.ceil(link.wire_bytes(kv)),
                  keeps_floor, None, parts)


#: How often the receiver places a quantised stream's completed blocks into its cache while the stream
#: arrives (``receiver/handoffs.py``; ``common/model/kvcache.LiveRebuild``).
LIVE_REBUILD_EVERY_S: Final = 0.025


def _rebuilds_live(level: PrecisionLevel, receiver: ReceiverModel) -> bool:
    """Whether a receiver builds a stream at ``level`` as it arrives: a quantised one, on a receiver that
    measured its rebuild (one that states it runs the code that builds live)."""
    return level.bf16_ratio is not None and receiver.rebuild_s_per_token is not None


def _left_at_ready(rebuild_s: float, arrival_s: float) -> float:
    """What is left of a rebuild of ``rebuild_s`` placed while its stream arrives over ``arrival_s``: the
    backlog where placing is slower than arriving, else the last placement period's share."""
    if arrival_s <= 0:
        return rebuild_s
    return max(rebuild_s - arrival_s, rebuild_s * min(1.0, LIVE_REBUILD_EVERY_S / arrival_s))


def _rebuild_s(n_tokens: float, geometry: KVGeometry, level: PrecisionLevel,
               receiver: ReceiverModel) -> float:
    """Receiver time to turn ``n_tokens`` of received KV into cache tensors (not overlapped with the link:
    an upper bound until dequantisation runs as blocks decode): as the receiver measured it per token at
    this level (a mix: the mean of its two), else the level's constant per bf16 MB."""
    measured = receiver.rebuild_s_per_token
    names = MIXED_REBUILD_LEVELS.get(level.name, (level.name,))
    if measured is not None and all(name in MEASURED_REBUILD_LEVELS for name in names):
        per_token = sum(measured[MEASURED_REBUILD_LEVELS.index(name)] for name in names) / len(names)
        return n_tokens * per_token
    bf16_mb = n_tokens * 2 * geometry.n_layers * geometry.n_kv_heads * geometry.head_dim * 2 / MB
    return bf16_mb * level.rebuild_s_per_mb * receiver.rebuild_scale


def meeting_point(n_tokens: int, geometry: KVGeometry, level: PrecisionLevel, link: LinkModel,
                  receiver: ReceiverModel) -> float:
    """The real m in [0, N] where the receiver's front ends when the back has arrived.

    front(m) = owd + the front's chunks (``ReceiverModel.front_s``) and back(m) = handshake + owd +
    s (N - m), with s the link seconds per token at ``level``. The back's rebuild runs after both (the
    model worker computes the front until then) and shrinks as m grows, but by less per token than the
    front grows, so TTFT is least where front and back cross. front - back increases with m, so the
    crossing is unique: found by bisection over whole tokens, then interpolated between the two
    around it; 0 when even the first token is cheaper to ship, N when local prefill is never slower
    than the link.
    """
    _check_tokens(n_tokens)
    link = link.split_link()
    receiver = receiver.beside_stream(link)
    s = link.serialisation_s(level.bytes_per_token(geometry))

    def gap(m: int) -> float:  # front - back
        return receiver.front_s(m) - link.handshake_s - s * (n_tokens - m)

    if gap(1) >= 0:  # the first call alone outlasts the whole back
        return 0.0
    if gap(n_tokens) <= 0:
        return float(n_tokens)
    lo, hi = 1, n_tokens  # gap(lo) < 0 < gap(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if gap(mid) < 0:
            lo = mid
        else:
            hi = mid
    below, above = gap(lo), gap(hi)
    return lo + -below / (above - below)


def split_option(n_tokens: int, geometry: KVGeometry, level: PrecisionLevel, link: LinkModel,
                 receiver: ReceiverModel, keeps_floor: bool) -> Option:
    """Compute the front, stream the back, at the integer meeting point that finishes first."""
    root = meeting_point(n_tokens, geometry, level, link, receiver)
    candidates = {min(n_tokens, max(0, math.floor(root))), min(n_tokens, max(0, math.ceil(root)))}
    return min((split_at(m, n_tokens, geometry, level, link, receiver, keeps_floor) for m in candidates),
               key=lambda o: (o.ttft_s, o.meeting_token))


def split_at(m: int, n_tokens: int, geometry: KVGeometry, level: PrecisionLevel, link: LinkModel,
             receiver: ReceiverModel, keeps_floor: bool = True) -> Option:
    """The split with the receiver computing [0, m) and the link carrying [m, N) at ``level``.

    The front is computed in chunks (``ReceiverModel.front_s``); the back has arrived when its last byte
    has landed. The receiver's model worker then rebuilds the back (it was busy with the front until
    then), joins both halves, runs the question and decodes: TTFT = max(front, back) + rebuild + join +
    question + one decode step.
    """
    _check_tokens(n_tokens)
    if not 0 <= m <= n_tokens:
        raise ValueError(f"meeting token {m!r} lies outside the context [0, {n_tokens}]")
    link = link.split_link()
    receiver = receiver.beside_stream(link)
    back_tokens = n_tokens - m
    kv = back_tokens * level.bytes_per_token(geometry)
    # The receiver rebuilds from its whole stream plan (the back, then the front after it: every block's
    # pieces are unpacked and the whole cache placed, the computed rows joined over it): as measured per
    # context token, the rebuild costs the whole context; the constants count the back's tokens.
    rebuilt = n_tokens if receiver.rebuild_s_per_token is not None else back_tokens
    rebuild = _rebuild_s(rebuilt, geometry, level, receiver) if back_tokens else 0.0
    front = link.owd_s + receiver.front_s(m)
    back = link.handshake_s + link.owd_s + link.serialisation_s(kv) if back_tokens else 0.0
    if back_tokens and _rebuilds_live(level, receiver):
        # Placed as it arrives: between the front's chunks (lengthening the front), then in the idle worker
        # until the back has landed. Left at ready: what landed during the front's last chunk, when the
        # front ends last; else the last period's share, or the backlog.
        whole = rebuild
        if front >= back:
            last = receiver.prefill.chunk_seconds(max(0, m - FRONT_CHUNK_TOKENS), m)
            last_chunk = receiver.front_scale * last
            rebuild = whole * min(1.0, max(LIVE_REBUILD_EVERY_S, last_chunk) / back)
            front += whole - rebuild
        else:
            during = whole * front / back
            front += during
            rebuild = _left_at_ready(whole - during, max(0.0, back - front))
    parts = {"front_s": front, "back_s": back, "rebuild_s": rebuild, "join_s": receiver.join_s,
             "question_s": receiver.question_s(n_tokens),
             "decode_s": receiver.decode_at(n_tokens + receiver.question_tokens)}
    ttft = max(front, back) + rebuild + receiver.join_s + parts["question_s"] + parts["decode_s"]
    return Option("split", level.name, ttft, kv, math.ceil(link.wire_bytes(kv)), keeps_floor, m, parts)


# Predicted TTFTs within this share of the fastest count as a tie: the model is not that exact, and
# without it the choice flickers between levels whose integer meeting points differ by a token.
DEFAULT_TIE_TOLERANCE: Final = 0.02


def plan_handoff(n_tokens: int, geometry: KVGeometry, link: LinkModel, receiver: ReceiverModel,
                 levels: Sequence[PrecisionLevel] = DEFAULT_PRECISION_LEVELS, floor: str = DEFAULT_FLOOR,
                 tie_tolerance: float = DEFAULT_TIE_TOLERANCE, deadline_s: float | None = None,
                 local_margin: float = LOCAL_MARGIN, modes: Sequence[str] = MODES) -> Plan:
    """Predict every option's TTFT for ``n_tokens`` and choose: fidelity first, then speed.

    A level keeps the floor when its mean KL is at most the floor level's; local prefill is exact. A
    stream (handoff or split) that keeps the floor is a candidate when it is predicted at least
    ``local_margin`` faster than local prefill; none is: local. Of the candidates that start generating by
    ``deadline_s`` (None: every candidate) the most faithful level wins, the fastest mode at that level;
    when none fits the deadline, the fastest candidate. Options within ``tie_tolerance`` (a share) of the
    fastest tie; a tie goes to the simpler mode (handoff, then split), then to the more faithful level.
    Only streams of ``modes`` are candidates (every option is still predicted and reported).
    """
    _check_tokens(n_tokens)
    if not levels:
        raise ValueError("no precision levels given")
    if not (math.isfinite(tie_tolerance) and 0 <= tie_tolerance < 1):
        raise ValueError(f"tie tolerance must lie in [0, 1), got {tie_tolerance!r}")
    if not (math.isfinite(local_margin) and 0 <= local_margin < 1):
        raise ValueError(f"local margin must lie in [0, 1), got {local_margin!r}")
    if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
        raise ValueError(f"deadline must be a positive number of seconds, got {deadline_s!r}")
    options = [local_option(int(n_tokens), link, receiver)]
    for make in (handoff_option, split_option):
        for level in levels:
            options.append(make(int(n_tokens), geometry, level, link, receiver,
                                keeps_floor(level.name, floor, levels)))
    fidelity = {level.name: level.mean_kl for level in levels} | {"exact": -1.0}
    local = options[0]
    beating = [o for o in options[1:]
               if o.keeps_floor and o.mode in modes and beats_local(o.ttft_s, local.ttft_s, local_margin)]
    fitting = [o for o in beating if deadline_s is None or o.ttft_s - o.parts["decode_s"] <= deadline_s]
    if fitting:  # the most faithful level that fits, then its fastest mode
        best = min(fidelity[o.precision] for o in fitting)
        pool = [o for o in fitting if fidelity[o.precision] == best]
    else:
        pool = beating or [local]

    def key(o: Option) -> tuple[int, float, float]:
        return MODES.index(o.mode), fidelity[o.precision], o.ttft_s

    fastest = min(o.ttft_s for o in pool)
    choice = min((o for o in pool if o.ttft_s <= fastest * (1 + tie_tolerance)), key=key)
    return Plan(int(n_tokens), floor, tuple(options), choice)
