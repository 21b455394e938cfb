"""What the sender ships: prefill -> block plan -> utility order -> symbols (runs in a worker thread).

``prepare_model`` uses the model runtime (``common/model/llm.py``, imported lazily so the transport never
loads torch); ``prepare_synthetic`` fills the same plan with random bytes (transport benchmarks, tests).

Precision: ``native`` sends the plan's fragments in the model's dtype (as ever); a quantised mix
(``common/plan/stream.py``) quantises the cache here, in the worker thread, and sends the piece plan's
symbols, each with its 4-byte stream index; ``auto`` asks the break-even planner which mix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.plan.handoff import BLOCK_TOKENS, LOCAL_SOURCE_SYMBOLS, ModelIdentity, PrefixOffer
from pfec.common.plan.kvlayout import FRAGMENT_ID_SIZE, BlockPlan, KVGeometry
from pfec.common.plan.mode_choice import (
    AUTO_MODES,
    AUTO_MODES_UNSTATED,
    ModeChoice,
    choose_mix,
    choose_mode,
    handoff_deadline_s,
)
from pfec.common.plan.pieces import HeldBlocks, Level
from pfec.common.plan.precision import SCHEME as QUANT_SCHEME
from pfec.common.plan.precision import FidelityTable, PieceLayout, PiecePlan
from pfec.common.plan.stream import (
    AUTO,
    MIXES,
    NATIVE,
    PrecisionOffer,
    fidelity_name_for,
    fidelity_named,
    mix_summary,
    plan_digest,
    split_order,
    stream_plan,
    symbol_token_ends,
)
from pfec.common.plan.utility import UtilityProfile, fifo_order, utility_order

if TYPE_CHECKING:
    from pfec.common.model.kvcache import KVCache, PartialKV
    from pfec.common.model.llm import ModelRuntime


class Prefilled:
    """A conversation's cache, made whole by the OpenAI face before the handoff (its salt goes with it):
    the handoff streams it without prefilling again. The cache is handed over once (``take``), so a kept
    handoff record holds no KV. ``held``: a conversation this node received before (a chain): the level it
    holds each received block at, lost ones included (``HeldBlocks``); the handoff passes that on."""

    def __init__(self, salt: str, context_ids: tuple[int, ...], kv: PartialKV, cached_tokens: int,
                 held: HeldBlocks | None = None) -> None:
        self.salt = salt
        self.context_ids = context_ids
        self.cached_tokens = cached_tokens  # of context_ids, found in the store (the rest prefilled)
        self._kv: PartialKV | None = kv
        self.held = held

    def take(self) -> KVCache:
        if self._kv is None:
            raise ValueError("the conversation's cache was already handed over")
        kv, self._kv = self._kv, None
        return kv.fresh_cache()


@dataclass(frozen=True)
class ContextInput:
    """The context and question, as text or as token ids (exactly one form each), or a conversation's
    prefilled cache (no question: the receiver keeps it for the requests that continue it). ``cache_salt``:
    the namespace the receiver keeps a question/answer context under ("" the shared one, as vLLM's prefix
    cache without a salt); a conversation's is its own."""

    context: str | None = None
    question: str | None = None
    context_ids: tuple[int, ...] | None = None
    question_ids: tuple[int, ...] | None = None
    system: str | None = None
    synthetic_tokens: int | None = None  # no model: random KV of this many tokens
    prefilled: Prefilled | None = None
    cache_salt: str = ""

    def prefix(self, context_ids: tuple[int, ...]) -> PrefixOffer:
        """The OFFER's prefix: the context's ids under the conversation's salt or the request's."""
        salt = self.prefilled.salt if self.prefilled is not None else self.cache_salt
        return PrefixOffer(salt, context_ids)


@dataclass(frozen=True)
class PrecisionRequest:
    """The precision asked for and the link it is planned for (``auto`` needs the rate and RTT)."""

    precision: str = NATIVE  # auto, or a mix of stream.MIXES
    rate_bps: float = 100e6
    rtt_s: float = 0.02
    mode: str = "handoff"  # auto, handoff (whole cache), split (compute the front, stream the back), local
    # The handoff's deadline, as its spec gives it (rho of the native KV's serialisation, or ms): auto
    # picks the most faithful option that starts generating by it (None: no deadline to meet).
    rho: float | None = None
    deadline_ms: float | None = None
    # The receiver's speed as it stated it after an earlier handoff (None: the stored curve).
    receiver: ReceiverModel | None = None
    # The path's loss as earlier handoffs to this receiver measured it (0: none measured yet).
    loss: float = 0.0
    # The rate the planner divides by: the path's cautious forecast where the sender measures it
    # (``PathRate.forecast_bps``); None: ``rate_bps``. A ``rho`` deadline stays on ``rate_bps`` (the told
    # rate defines it; the receiver's deadline does not move with the sender's estimate).
    plan_rate_bps: float | None = None
    # The path's forecast as the newest split over it left it (the receiver computed beside that stream);
    # None: ``planning_rate_bps``.
    split_rate_bps: float | None = None

    @property
    def planning_rate_bps(self) -> float:
        return self.rate_bps if self.plan_rate_bps is None else self.plan_rate_bps

    def deadline_s(self, n_tokens: int, geometry: KVGeometry) -> float | None:
        owd_s = self.rtt_s / 2
        return handoff_deadline_s(n_tokens, geometry, self.rate_bps, owd_s, self.rho, self.deadline_ms)


@dataclass(frozen=True)
class Split:
    """A split (or local) handoff: the receiver prefills [0, ``meeting_token``) from ``context_ids``; the
    stream carries the back, each symbol's token end in send order (``stream.symbol_token_ends``)."""

    meeting_token: int
    context_ids: tuple[int, ...]
    token_ends: npt.NDArray[np.int64]


@dataclass
class Stream:
    """A quantised handoff's stream: its piece plan and what the OFFER says about it."""

    mix: str
    plan: PiecePlan
    offer: PrecisionOffer
    block_of_symbol: npt.NDArray[np.int64]  # block of the piece holding each symbol's first byte
    quantise_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"stream_bytes": self.plan.total_bytes, "n_pieces": self.plan.n_pieces,
                "plan_digest": self.offer.plan, "fidelity": self.offer.fidelity, **mix_summary(self.plan)}


@dataclass
class Prepared:
    plan: BlockPlan
    block_utility: npt.NDArray[np.float64]
    queue: npt.NDArray[np.int64]  # fragment ids (or stream indices) in send order
    symbols: npt.NDArray[np.uint8]  # [n_source, S], row i = symbol of queue[i]
    question_ids: tuple[int, ...]
    prefill_s: float
    profile: str
    cache: KVCache | None = None  # the intact cache (kept only for the full-KV answer)
    extra: dict[str, Any] = field(default_factory=dict)
    stream: Stream | None = None  # a quantised mix; None: the plan's native fragments
    planner: dict[str, Any] | None = None  # choose_mix's / choose_mode's view
    split: Split | None = None  # a split or local handoff (None: the whole cache streams)
    prefix: PrefixOffer | None = None  # the context's ids: the receiver keeps its cache under their salt
    held: HeldBlocks | None = None  # a chain: what this node holds of the context, for the OFFER

    @property
    def precision(self) -> str:
        if self.handoff_mode == "local":
            return "none"  # nothing streams
        return NATIVE if self.stream is None else self.stream.mix

    @property
    def handoff_mode(self) -> str:
        if self.split is None:
            return "handoff"
        return "local" if self.split.meeting_token >= self.plan.n_tokens else "split"

    @property
    def n_source(self) -> int:
        return len(self.queue)


def _block_order(plan: BlockPlan, utilities: npt.NDArray[np.float64], order: str) -> npt.NDArray[np.int64]:
    return np.asarray(utility_order(utilities) if order == "utility" else fifo_order(plan.n_blocks),
                      dtype=np.int64)


def _order(plan: BlockPlan, utilities: npt.NDArray[np.float64], order: str) -> npt.NDArray[np.int64]:
    return plan.fragment_queue(_block_order(plan, utilities, order))


def plan_stream(identity: ModelIdentity, n_tokens: int, mix: str, utilities: npt.NDArray[np.float64],
                order: str, first_block: int = 0, absent: npt.NDArray[np.bool_] | None = None) -> Stream:
    """The piece plan of a quantised ``mix`` for this handoff, with the OFFER's description of it. A split
    (``first_block`` > 0) streams the back, then the front after it (``stream_plan``'s ``front_after``):
    what the receiver's prefill does not reach in time still arrives if the link has time for it.
    ``absent``: a chain's blocks lost upstream, streamed as lost (no pieces; the receiver plans the same)."""
    native = identity.plan(n_tokens)
    n_layers = identity.geometry.n_layers
    digest = identity.details.get("model_digest")
    fidelity_name = fidelity_name_for(n_layers, digest)
    fidelity: FidelityTable = fidelity_named(fidelity_name, n_layers, digest)
    layout = PieceLayout(identity.geometry, n_tokens, BLOCK_TOKENS)
    plan = stream_plan(layout, mix, utilities, fidelity, native.symbol_size - FRAGMENT_ID_SIZE, order,
                       first_block, front_after=first_block > 0, absent=absent)
    offer = PrecisionOffer(QUANT_SCHEME, mix, layout.block_tokens, layout.value_group, fidelity_name,
                           plan_digest(plan, mix, fidelity_name))
    first_piece, _ = plan.symbol_piece_spans()
    return Stream(mix, plan, offer, plan.blocks[first_piece].astype(np.int64))


def _mix_for(identity: ModelIdentity, n_tokens: int, request: PrecisionRequest, question_tokens: int,
             ) -> tuple[str, dict[str, Any] | None]:
    geometry = identity.geometry
    mix, view = choose_mix(request.precision, n_tokens, geometry, request.planning_rate_bps, request.rtt_s,
                           request.receiver, deadline_s=request.deadline_s(n_tokens, geometry),
                           loss=request.loss, question_tokens=question_tokens)
    if request.precision == NATIVE:  # nothing to decide: the report still shows what the planner predicts
        view["predicted_only"] = True
    return mix, view


def prompt_ids(runtime: ModelRuntime, inp: ContextInput) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(context ids, question ids): given directly, or rendered with the model's chat template."""
    if inp.prefilled is not None:
        return inp.prefilled.context_ids, ()
    if inp.context_ids is not None and inp.question_ids is not None:
        return tuple(inp.context_ids), tuple(inp.question_ids)
    from pfec.common.model import llm  # deferred: torch

    if inp.context is None or inp.question is None:
        raise ValueError("give context and question as text, or context_ids and question_ids")
    if runtime.tokenizer is None:
        raise ValueError("this model has no tokenizer: give context_ids and question_ids")
    system = inp.system if inp.system is not None else llm.DEFAULT_SYSTEM
    prompt = llm.chat_prompt(runtime, inp.context, inp.question, system=system or None)
    return prompt.context_ids, prompt.question_ids


def prepare_model(
    runtime: ModelRuntime, identity: ModelIdentity, inp: ContextInput, order: str, profile: UtilityProfile,
    profile_name: str, keep_cache: bool, max_new_tokens: int = 24, max_context_tokens: int | None = None,
    precision: PrecisionRequest | None = None,
) -> Prepared:
    """Prefill the context and cut its KV into symbols in ``order`` (native fragments, or the quantised
    stream of the mix ``precision`` resolves to); ValueError for a context longer than the model's or
    than ``max_context_tokens`` (the node's configured bound), before any prefill."""
    from pfec.common.model import llm  # deferred: torch

    context_ids, question_ids = prompt_ids(runtime, inp)
    if max_context_tokens is not None and len(context_ids) > max_context_tokens:
        raise ValueError(f"context: {len(context_ids)} tokens, above limits.max_context_tokens "
                         f"({max_context_tokens})")
    llm.check_length(runtime, len(context_ids), len(question_ids) + max_new_tokens)
    request = precision or PrecisionRequest()
    plan = identity.plan(len(context_ids))
    utilities = profile.block_utilities(plan)
    held = inp.prefilled.held if inp.prefilled is not None else None
    if held is not None:  # a chain streams what this node holds, whole (a front computed there would not be)
        request = replace(request, mode="handoff")
    choice: ModeChoice | None = None
    if request.mode != "handoff" and not (request.mode == AUTO and request.precision == NATIVE):
        # a split's front runs at the receiver's speed: not chosen on the stored curve (none stated, or
        # what it stated was absurd and defaulted)
        stated = request.receiver is not None and "prefill" not in request.receiver.defaulted
        auto_modes = AUTO_MODES if stated else AUTO_MODES_UNSTATED
        choice = choose_mode(request.mode, request.precision, plan.n_tokens, identity.geometry,
                             request.planning_rate_bps, request.rtt_s, request.receiver,
                             block_tokens=BLOCK_TOKENS,
                             auto_modes=auto_modes,
                             deadline_s=request.deadline_s(plan.n_tokens, identity.geometry),
                             loss=request.loss, question_tokens=len(question_ids),
                             split_rate_bps=request.split_rate_bps)
        if choice.mode != "handoff":
            return _prepare_split(runtime, inp, context_ids, question_ids, plan, utilities, order,
                                  profile_name, keep_cache, choice, identity)
    started = time.perf_counter()
    cache = _context_cache(runtime, inp, context_ids)
    prefill_s = time.perf_counter() - started
    prefix = inp.prefix(context_ids)
    planner: dict[str, Any] | None
    if choice is not None and choice.mix is not None:
        mix, planner = choice.mix, choice.view
    else:
        mix, planner = _mix_for(identity, plan.n_tokens, request, len(question_ids))
    absent = None if held is None else held.block_levels(plan) == Level.NONE  # lost upstream: not sent
    stream = None if mix == NATIVE else plan_stream(identity, plan.n_tokens, mix, utilities, order,
                                                    absent=absent)
    if held is not None and stream is not None and _below_held(stream, held.block_levels(plan)):
        stream = _raised(identity, plan, mix, utilities, order, held)
        planner = {**(planner or {}), "raised_from": mix,  # a block that arrived quantised bounds the mix
                   "mix": NATIVE if stream is None else stream.mix}
    if stream is None:
        queue = _order(plan, utilities, order)
        if held is not None:  # a block lost upstream is not streamed: the OFFER says it is lost
            queue = queue[_held_fragments(plan, held, queue)]
        symbols = llm.serialise_symbols(runtime, cache, plan, queue)
        return Prepared(plan, utilities, queue, symbols, question_ids, prefill_s, profile_name,
                        cache if keep_cache else None, planner=planner, prefix=prefix, held=held)
    started = time.perf_counter()
    symbols = llm.serialise_stream(runtime, cache, stream.plan)
    stream.quantise_s = time.perf_counter() - started
    queue = np.arange(stream.plan.n_symbols, dtype=np.int64)
    return Prepared(plan, utilities, queue, symbols, question_ids, prefill_s, profile_name,
                    cache if keep_cache else None, stream=stream, planner=planner, prefix=prefix, held=held)


def _below_held(stream: Stream, held: npt.NDArray[np.int8]) -> bool:
    """Whether the mix plans a block that arrived quantised below the level it arrived at: quantised again
    below what it holds. A block held native (received so, or computed here) is quantised once, as in any
    handoff; a block lost upstream (NONE) is no bound: it goes as lost."""
    planned = stream.plan.planned_levels()
    quantised = (held != Level.NONE) & (held != Level.NATIVE)
    return bool((quantised & (planned < held)).any())


def _raised(identity: ModelIdentity, plan: BlockPlan, mix: str, utilities: npt.NDArray[np.float64],
            order: str, held: HeldBlocks) -> Stream | None:
    """The nearest mix above ``mix`` that plans no block that arrived quantised below its level (None:
    native, which is below nothing)."""
    levels = held.block_levels(plan)
    for above in reversed(MIXES[1:MIXES.index(mix)]):
        stream = plan_stream(identity, plan.n_tokens, above, utilities, order, absent=levels == Level.NONE)
        if not _below_held(stream, levels):
            return stream
    return None


def _held_fragments(plan: BlockPlan, held: HeldBlocks, queue: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Which fragments of ``queue`` belong to blocks this node holds (not lost upstream)."""
    present = held.block_levels(plan) != Level.NONE
    block_of_fragment = np.repeat(np.arange(plan.n_blocks), np.diff(plan.first_fragment))
    return np.asarray(present[block_of_fragment[queue]])


def _context_cache(runtime: ModelRuntime, inp: ContextInput, context_ids: Sequence[int]) -> KVCache:
    """The context's cache: a conversation's prefilled one, else a prefill here."""
    from pfec.common.model import llm  # deferred: torch

    if inp.prefilled is not None:
        return inp.prefilled.take()
    cache, _ = llm.prefill(runtime, context_ids)
    return cache


def _prepare_split(runtime: ModelRuntime, inp: ContextInput, context_ids: tuple[int, ...],
                   question_ids: tuple[int, ...], plan: BlockPlan, utilities: npt.NDArray[np.float64],
                   order: str, profile_name: str, keep_cache: bool, choice: ModeChoice,
                   identity: ModelIdentity) -> Prepared:
    """A split (the back's quantised stream, each symbol's token end) or a local prefill (nothing); the
    context's prefix goes with either (the receiver keeps what it rebuilt, the computed front joined)."""
    prepared = _prepare_split_kv(runtime, inp, context_ids, question_ids, plan, utilities, order,
                                 profile_name, keep_cache, choice, identity)
    prepared.prefix = inp.prefix(context_ids)
    return prepared


def _prepare_split_kv(runtime: ModelRuntime, inp: ContextInput, context_ids: tuple[int, ...],
                      question_ids: tuple[int, ...], plan: BlockPlan, utilities: npt.NDArray[np.float64],
                      order: str, profile_name: str, keep_cache: bool, choice: ModeChoice,
                      identity: ModelIdentity) -> Prepared:
    from pfec.common.model import llm  # deferred: torch

    cache, prefill_s = None, 0.0
    if choice.mode == "split" or keep_cache:  # local needs no KV here (only for the full-KV answer)
        started = time.perf_counter()
        cache = _context_cache(runtime, inp, context_ids)
        prefill_s = time.perf_counter() - started
    width = plan.symbol_size
    if choice.mode == "local":
        split = Split(plan.n_tokens, tuple(context_ids), np.zeros(0, dtype=np.int64))
        queue = np.arange(LOCAL_SOURCE_SYMBOLS, dtype=np.int64)
        return Prepared(plan, utilities, queue, np.zeros((LOCAL_SOURCE_SYMBOLS, width), dtype=np.uint8),
                        question_ids, prefill_s, profile_name, cache if keep_cache else None,
                        planner=choice.view, split=split)
    assert choice.mix is not None and choice.meeting_token is not None and cache is not None
    first_block = choice.meeting_token // BLOCK_TOKENS
    if choice.mix == NATIVE:  # the native fragments: the back's blocks, then the front's after them
        in_order = _block_order(plan, utilities, order)
        blocks = in_order[split_order(in_order % plan.n_token_blocks, first_block, True)]
        queue = plan.fragment_queue(blocks)
        symbols = llm.serialise_symbols(runtime, cache, plan, queue)
        split = Split(choice.meeting_token, tuple(context_ids), plan.fragment_token_end[queue])
        return Prepared(plan, utilities, queue, symbols, question_ids, prefill_s, profile_name,
                        cache if keep_cache else None, planner=choice.view, split=split)
    stream = plan_stream(identity, plan.n_tokens, choice.mix, utilities, order, first_block)
    started = time.perf_counter()
    symbols = llm.serialise_stream(runtime, cache, stream.plan)
    stream.quantise_s = time.perf_counter() - started
    queue = np.arange(stream.plan.n_symbols, dtype=np.int64)
    split = Split(choice.meeting_token, tuple(context_ids), symbol_token_ends(stream.plan))
    return Prepared(plan, utilities, queue, symbols, question_ids, prefill_s, profile_name,
                    cache if keep_cache else None, stream=stream, planner=choice.view, split=split)


def prepare_synthetic(identity: ModelIdentity, n_tokens: int, order: str, profile: UtilityProfile,
                      profile_name: str, seed: int, question_ids: Sequence[int] = (),
                      precision: PrecisionRequest | None = None) -> Prepared:
    """Random KV bytes in the model's plan (fragment ids are real, so the receiver files them); a quantised
    mix sends random piece bytes in its piece plan (stream indices are real). ``auto`` means native here:
    random bytes have no precision to trade."""
    plan = identity.plan(n_tokens)
    utilities = profile.block_utilities(plan)
    rng = np.random.default_rng(seed)
    request = precision or PrecisionRequest()
    if request.mode in ("split", "local"):
        raise ValueError(f"mode {request.mode}: synthetic KV has no model for the receiver to prefill with "
                         "(use handoff or auto)")
    if request.precision not in (NATIVE, AUTO):
        stream = plan_stream(identity, n_tokens, request.precision, utilities, order)
        width = stream.plan.symbol_size + FRAGMENT_ID_SIZE
        raw = np.frombuffer(bytearray(rng.bytes(stream.plan.n_symbols * width)), dtype=np.uint8)
        symbols = raw.reshape(stream.plan.n_symbols, width)
        queue = np.arange(stream.plan.n_symbols, dtype=np.int64)
        symbols[:, :4] = queue.astype(">u4").view(np.uint8).reshape(-1, 4)
        return Prepared(plan, utilities, queue, symbols, tuple(question_ids), 0.0, profile_name,
                        stream=stream)
    queue = _order(plan, utilities, order)
    symbols = np.frombuffer(bytearray(rng.bytes(plan.n_fragments * plan.symbol_size)), dtype=np.uint8)
    symbols = symbols.reshape(plan.n_fragments, plan.symbol_size)
    symbols[:, :4] = queue.astype(">u4").view(np.uint8).reshape(-1, 4)
    return Prepared(plan, utilities, queue, symbols, tuple(question_ids), 0.0, profile_name)


def full_kv_answer(runtime: ModelRuntime, prepared: Prepared, max_new_tokens: int,
                   at_wire_dtype: bool = False) -> str:
    """The sender's own answer from its intact cache (the reference the handoff is compared with). With
    ``at_wire_dtype``, from that cache rounded to the transfer dtype and back: what a handoff answers
    whose every byte arrived at native precision (a greedy answer near a tie can flip on that rounding)."""
    from pfec.common.model import llm  # deferred: torch

    if prepared.cache is None:
        raise ValueError("the intact cache was not kept for this handoff")
    kv = llm.partial_from_cache(prepared.cache, None, "mask")
    if at_wire_dtype:
        wire = runtime.transfer_dtype
        kv = replace(kv, keys=[k.to(wire).to(k.dtype) for k in kv.keys],
                     values=[v.to(wire).to(v.dtype) for v in kv.values])
    return llm.generate(runtime, kv, prepared.question_ids, max_new_tokens).text
