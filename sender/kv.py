"""What the sender ships: prefill -> block plan -> utility order -> symbols (runs in a worker thread).

``prepare_model`` uses the model runtime (``common/model/llm.py``, imported lazily so the transport never
loads torch); ``prepare_synthetic`` fills the same plan with random bytes (transport benchmarks, tests).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from pfec.common.plan.handoff import ModelIdentity
from pfec.common.plan.kvlayout import BlockPlan
from pfec.common.plan.utility import UtilityProfile, fifo_order, utility_order

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime


@dataclass(frozen=True)
class ContextInput:
    """The context and question, as text or as token ids (exactly one form each)."""

    context: str | None = None
    question: str | None = None
    context_ids: tuple[int, ...] | None = None
    question_ids: tuple[int, ...] | None = None
    system: str | None = None
    synthetic_tokens: int | None = None  # no model: random KV of this many tokens


@dataclass
class Prepared:
    plan: BlockPlan
    block_utility: npt.NDArray[np.float64]
    queue: npt.NDArray[np.int64]  # fragment ids in send order
    symbols: npt.NDArray[np.uint8]  # [n_source, S], row i = symbol of queue[i]
    question_ids: tuple[int, ...]
    prefill_s: float
    profile: str
    cache: Any = None  # the intact DynamicCache (kept only for the full-KV answer; a torch type)
    extra: dict[str, Any] = field(default_factory=dict)


def _order(plan: BlockPlan, utilities: npt.NDArray[np.float64], order: str) -> npt.NDArray[np.int64]:
    blocks = utility_order(utilities) if order == "utility" else fifo_order(plan.n_blocks)
    return plan.fragment_queue(blocks)


def prompt_ids(runtime: ModelRuntime, inp: ContextInput) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(context ids, question ids): given directly, or rendered with the model's chat template."""
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
) -> Prepared:
    """Prefill the context and cut its KV into symbols in ``order``; ValueError for a context longer than
    the model's or than ``max_context_tokens`` (the node's configured bound), before any prefill."""
    from pfec.common.model import llm  # deferred: torch

    context_ids, question_ids = prompt_ids(runtime, inp)
    if max_context_tokens is not None and len(context_ids) > max_context_tokens:
        raise ValueError(f"context: {len(context_ids)} tokens, above limits.max_context_tokens "
                         f"({max_context_tokens})")
    llm.check_length(runtime, len(context_ids), len(question_ids) + max_new_tokens)
    started = time.perf_counter()
    cache, _ = llm.prefill(runtime, context_ids)
    prefill_s = time.perf_counter() - started
    plan = identity.plan(len(context_ids))
    utilities = profile.block_utilities(plan)
    queue = _order(plan, utilities, order)
    symbols = llm.serialise_symbols(runtime, cache, plan, queue)
    return Prepared(plan, utilities, queue, symbols, question_ids, prefill_s, profile_name,
                    cache if keep_cache else None)


def prepare_synthetic(identity: ModelIdentity, n_tokens: int, order: str, profile: UtilityProfile,
                      profile_name: str, seed: int, question_ids: Sequence[int] = ()) -> Prepared:
    """Random KV bytes in the model's plan (fragment ids are real, so the receiver files them)."""
    plan = identity.plan(n_tokens)
    utilities = profile.block_utilities(plan)
    queue = _order(plan, utilities, order)
    rng = np.random.default_rng(seed)
    symbols = np.frombuffer(bytearray(rng.bytes(plan.n_fragments * plan.symbol_size)), dtype=np.uint8)
    symbols = symbols.reshape(plan.n_fragments, plan.symbol_size)
    symbols[:, :4] = queue.astype(">u4").view(np.uint8).reshape(-1, 4)
    return Prepared(plan, utilities, queue, symbols, tuple(question_ids), 0.0, profile_name)


def full_kv_answer(runtime: ModelRuntime, prepared: Prepared, max_new_tokens: int) -> str:
    """The sender's own answer from its intact cache (the reference the handoff is compared with)."""
    from pfec.common.model import llm  # deferred: torch

    if prepared.cache is None:
        raise ValueError("the intact cache was not kept for this handoff")
    kv = llm.partial_from_cache(prepared.cache, None, "mask")
    return llm.generate(runtime, kv, prepared.question_ids, max_new_tokens).text
