"""`pfec eval` stage 2: needle-QA answers from each scheme's partial KV cache (default model), scored.

The prompts are ``workloads.needle_suite``: balanced over question kinds and needle depths, one essay per
prompt, with short-answer prompting (a system prompt and an instruction asking for the value only, and the
needle's stem as the assistant's first words, so the model's first words are the value). Prompt i meets
loss realization i under every scheme; the answer is generated from the blocks the scheme completed by the
deadline, with the mask and the zero receiver, and scored by ``kv.answer_score`` (normalised exact match,
gold-contained, token F1, agreement with the full-KV answer), with paired summaries against the reference
scheme. This module loads torch and the model, so ``evaluate`` imports it only when the task stage runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache

from pfec.common.model import llm
from pfec.common.plan.kvlayout import BlockPlan
from pfec.common.plan.utility import UtilityProfile
from pfec.lab.eval.config import MODES, NAMED_CONFIGS, EvalConfig
from pfec.lab.kv.answer_score import METRICS, score_answer, summarise
from pfec.lab.kv.profiler import check_profile
from pfec.lab.kv.retention import blocks_available
from pfec.lab.kv.workloads import SHORT_ANSWER_SYSTEM, QAExample, best_f1, needle_suite
from pfec.lab.reporting.progress import StageProgress
from pfec.lab.sim.channel import LossModel, parse_loss_spec
from pfec.lab.sim.simulate import Handoff, prepare, run_scheme

__all__ = ["REFERENCE_SCHEME", "AnswerBatch", "task_scores"]

REFERENCE_SCHEME = "priorityfec"  # every scheme's paired difference is taken against it, when it ran

def task_scores(
    cfg: EvalConfig,
    task_schemes: Sequence[tuple[str, str]],
    rhos: Sequence[float],
    progress: StageProgress | None = None,
    prefill_store: Path | None = None,
) -> dict[str, Any]:
    """Answer scores of each scheme's delivered partial cache (default model, main GE config).

    ``task_schemes``: (label, scheme that runs); a label given twice is scored once. Prompt i uses loss
    realization i for every scheme. Prompts are spread over ``cfg.jobs`` processes (each loads the model
    with one torch thread: the simulator is single-threaded and one decode step barely uses a second
    core), so the stage's cost is divided by the cores rather than by torch's intra-op speed-up.
    ``prefill_store``: a folder of this run where prompts' prefilled caches are kept for a later stage
    (``prefilled``).
    """
    task_schemes = list(dict(task_schemes).items())
    runtime = llm.load_model("default", device="cpu")
    examples = needle_suite(cfg.task_prompts, cfg.context_tokens, cfg.seed, split="eval",
                            count_tokens=partial(llm.count_tokens, runtime))  # fmt: skip
    jobs = (cfg, tuple(task_schemes), tuple(rhos), prefill_store)
    total = len(examples) * len(rhos) * len(task_schemes)
    rows: list[dict[str, Any]] = []
    full_rows: list[dict[str, Any]] = []
    for full_row, prompt_rows in map_prompts(cfg.jobs, cfg, partial(_prompt_rows, jobs),
                                              list(enumerate(examples))):
        full_rows.append(full_row)
        rows += prompt_rows
        if progress is not None:
            progress("task score", len(rows) // len(MODES), total)
    full_rows.sort(key=lambda r: int(r["prompt"]))
    rows.sort(key=lambda r: int(r["prompt"]))  # the order of a one-process run, whatever finished first
    paired = REFERENCE_SCHEME if any(label == REFERENCE_SCHEME for label, _ in task_schemes) else None
    return {
        "rows": rows,
        "full_kv": full_rows,
        "summary": _task_summary(rows, paired),
        "full_kv_f1_gold": float(np.mean([r["f1"] for r in full_rows])),
        "full_kv_scores": {m: float(np.mean([r[m] for r in full_rows])) for m in (*METRICS, "words")},
        "inputs": {
            "model": runtime.model_id,
            "prompts": len(examples),
            "workload": "needle_suite (kinds x depths balanced, one essay per prompt)",
            "prompting": {"system": SHORT_ANSWER_SYSTEM, "answer_prefix": "the needle's stem"},
            "metrics": list(METRICS),
            "paired_reference": paired,
            "context_tokens": cfg.context_tokens,
            "loss": NAMED_CONFIGS["main"],
            "rhos": list(rhos),
            "modes": list(MODES),
            "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed,
            "processes": max(1, min(cfg.jobs, len(examples))),
        },
    }


_Job = tuple[EvalConfig, tuple[tuple[str, str], ...], tuple[float, ...], Path | None]
MODEL_WORKER: dict[str, Any] = {}  # per process: the model runtime and utility profile, loaded once
_Item = TypeVar("_Item")
_Out = TypeVar("_Out")


def init_model_worker(cfg: EvalConfig, threads: int | None) -> None:
    """Load the default model (and the run's utility profile) into ``MODEL_WORKER`` for this process."""
    if threads is not None:
        torch.set_num_threads(threads)
    runtime = llm.load_model("default", device="cpu")
    llm.warm_up(runtime)
    profile = cfg.load_profile(runtime.geometry.n_layers)
    if cfg.profile != "synthetic":
        check_profile(runtime, profile)
    MODEL_WORKER.update(runtime=runtime, profile=profile)


def map_prompts(
    jobs: int, cfg: EvalConfig, fn: Callable[[_Item], _Out], items: list[_Item]
) -> Iterator[_Out]:
    """``fn`` over ``items`` with the model loaded: in this process (``jobs`` 1) or a spawned pool, whose
    results come as they finish. Spawn, not fork: a fresh interpreter per worker (no inherited threads or
    signal handlers; see eval_sweep). Shared by the task and the precision stages."""
    workers = max(1, min(jobs, len(items)))
    if workers == 1:
        init_model_worker(cfg, None)
        for item in items:
            yield fn(item)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=init_model_worker, initargs=(cfg, 1)) as pool:
        yield from pool.imap_unordered(fn, items)


def _prompt_rows(job: _Job, item: tuple[int, QAExample]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One prompt: its full-KV answer, then every scheme's answer at every rho (mask and zero)."""
    cfg, task_schemes, rhos, store = job
    i, example = item
    runtime: llm.ModelRuntime = MODEL_WORKER["runtime"]
    loss = parse_loss_spec(cfg.main_loss_spec())
    context_ids, question_ids = short_answer_prompt(runtime, example)
    cache = prefilled(runtime, context_ids, store)
    plan = runtime.plan(len(context_ids))
    whole = llm.partial_from_cache(cache, None, "mask")
    full = llm.generate(runtime, whole, question_ids, cfg.max_new_tokens, first_line_only=True)
    full_row = {"prompt": i, **example.meta, **_score_answer(full.text, example.answers, None)}
    prompt_run = _PromptRun(cfg, runtime, cache, plan, question_ids, i, example, str(full_row["answer"]))
    rows: list[dict[str, Any]] = []
    for rho in rhos:
        handoff = _task_handoff(cfg, loss, rho, MODEL_WORKER["profile"], runtime, plan)
        for label, scheme in task_schemes:
            rows += prompt_run.rows(handoff, label, scheme, rho)
    prompt_run.answers.fill(rows)
    return full_row, rows


def prefilled(runtime: llm.ModelRuntime, context_ids: Sequence[int], store: Path | None) -> DynamicCache:
    """The context's full cache: loaded from ``store`` where an earlier stage of the run left it (the task
    and precision stages answer the same prompts), else prefilled here and left there. The file's name is
    a digest of the model and the context ids, so a stage can only find the cache of its own context."""
    if store is None:
        return llm.prefill(runtime, context_ids)[0]
    ids = np.asarray(context_ids, dtype=np.int64).tobytes()
    path = store / f"{hashlib.sha1(runtime.model_id.encode() + b'/' + ids).hexdigest()}.pt"
    if path.exists():
        cache = DynamicCache()
        for layer, (keys, values) in enumerate(torch.load(path, map_location=runtime.device)):
            cache.update(keys, values, layer)
        return cache
    cache = llm.prefill(runtime, context_ids)[0]
    partial_path = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save([(k.contiguous(), v.contiguous()) for k, v in llm.cache_layers(cache)], partial_path)
    partial_path.replace(path)  # whole or absent, should another process look at the same time
    return cache


def short_answer_prompt(runtime: llm.ModelRuntime, example: QAExample) -> tuple[list[int], list[int]]:
    """(context ids the sender prefills, ids the receiver feeds): the short-answer system prompt, and the
    question followed by the chat template's tail and the example's answer prefix (the assistant's start)."""
    prompt = llm.chat_prompt(runtime, example.context, example.question, system=SHORT_ANSWER_SYSTEM)
    question_ids = list(prompt.question_ids)
    if example.answer_prefix:
        if runtime.tokenizer is None:
            raise ValueError(f"model {runtime.model_id!r} has no tokenizer for the answer prefix")
        question_ids += runtime.tokenizer(example.answer_prefix, add_special_tokens=False).input_ids
    return list(prompt.context_ids), question_ids


def _task_handoff(
    cfg: EvalConfig,
    loss: LossModel,
    rho: float,
    profile: UtilityProfile,
    runtime: llm.ModelRuntime,
    plan: BlockPlan,
) -> Handoff:
    """The simulator's handoff of this prompt's context (the model's geometry and block plan)."""
    sim = replace(
        cfg.sim_config(loss, rho, profile),
        tokens=plan.n_tokens,
        geometry=runtime.geometry,
        max_symbol_size=llm.MAX_SYMBOL_SIZE,
    )
    handoff = prepare(sim)
    if handoff.plan.n_fragments != plan.n_fragments:
        raise RuntimeError("simulator plan differs from the runtime's block plan")
    return handoff


ANSWER_BATCH = 12  # partial caches decoded together: ~140 MB each for the default model at 1.5k tokens


class AnswerBatch:
    """One prompt's answers by delivered state, generated together.

    Rows name the answer they need by a key (the same delivered state gives the same answer whatever
    scheme or variant delivered it) with a way to build its partial cache; ``fill`` builds the caches
    ``batch`` at a time, decodes each group in one ``generate_batch`` and writes the scores into the rows.
    """

    def __init__(self, runtime: llm.ModelRuntime, question_ids: Sequence[int], max_new_tokens: int,
                 score: Callable[[str], dict[str, Any]], batch: int = ANSWER_BATCH,
                 timed: Callable[[str], contextlib.AbstractContextManager[None]] | None = None) -> None:
        self.runtime, self.question_ids, self.max_new_tokens = runtime, question_ids, max_new_tokens
        self.score, self.batch = score, batch
        self.timed = timed or (lambda _part: contextlib.nullcontext())
        self.pending: dict[bytes, Callable[[], llm.PartialKV]] = {}
        self.done: dict[bytes, dict[str, Any]] = {}
        self.generated = 0  # answers decoded (requests of an already known state cost nothing)

    def request(self, key: bytes, build: Callable[[], llm.PartialKV]) -> bytes:
        if key not in self.done:
            self.pending.setdefault(key, build)
        return key

    def fill(self, rows: list[dict[str, Any]]) -> None:
        """Generate what is pending, then replace each row's ``answer_key`` by that answer's scores."""
        keys = list(self.pending)
        for start in range(0, len(keys), self.batch):
            group = keys[start : start + self.batch]
            with self.timed("rebuild"):
                kvs = [self.pending[key]() for key in group]
            with self.timed("generate"):
                outs = llm.generate_batch(self.runtime, kvs, self.question_ids, self.max_new_tokens,
                                          first_line_only=True)  # the score reads the first line only
            for key, out in zip(group, outs, strict=True):
                self.done[key] = self.score(out.text)
            self.generated += len(group)
        self.pending.clear()
        for row in rows:
            row.update(self.done[row.pop("answer_key")])


class _PromptRun:
    """One prompt's scoring: answers are shared per (mode, delivered block set), as the same blocks give
    the same answer whatever scheme delivered them, and generated in batches (``AnswerBatch``)."""

    def __init__(
        self,
        cfg: EvalConfig,
        runtime: llm.ModelRuntime,
        cache: DynamicCache,
        plan: BlockPlan,
        question_ids: Sequence[int],
        index: int,
        example: QAExample,
        reference: str,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.cache = cache
        self.plan = plan
        self.question_ids = question_ids
        self.index = index  # the prompt's number, and the loss realization it meets
        self.example = example
        self.reference = reference
        self.answers = AnswerBatch(runtime, question_ids, cfg.max_new_tokens,
                                   partial(_score_answer, golds=example.answers, reference=reference))

    def rows(self, handoff: Handoff, label: str, scheme: str, rho: float) -> list[dict[str, Any]]:
        """One row per receiver mode for ``scheme`` (reported as ``label``) on this prompt's realization."""
        result = run_scheme(handoff, scheme, self.index)
        kept = np.flatnonzero(result.recovered_blocks)
        out = []
        for mode in MODES:
            key = mode.encode() + hashlib.sha1(kept.tobytes()).digest()
            self.answers.request(key, partial(self._kv_from_blocks, kept, mode))
            out.append(
                {
                    "prompt": self.index,
                    "rho": rho,
                    "scheme": label,
                    "runs": scheme,
                    "mode": mode,
                    "recovered_utility": result.recovered_utility,
                    "answer_key": key,
                }
            )
        return out

    def _kv_from_blocks(self, kept: npt.NDArray[np.int64], mode: str) -> llm.PartialKV:
        available = torch.from_numpy(blocks_available(self.plan, kept)).to(self.runtime.device)
        return llm.partial_from_cache(self.cache, available, mode, self.plan.n_tokens)  # type: ignore[arg-type]


def _score_answer(answer: str, golds: Sequence[str], reference: str | None) -> dict[str, Any]:
    """``answer_score``'s metrics, plus the report's older names (f1_gold, f1_full, correct)."""
    scored = score_answer(answer, golds, reference)
    line = scored["answer"]
    full = line if reference is None else reference
    return {
        **scored,
        "f1_gold": scored["f1"],
        "f1_full": best_f1(line, [full]) if full else float(not line),
        "correct": bool(scored["contained"]),
    }


def _task_summary(rows: list[dict[str, Any]], reference: str | None) -> list[dict[str, Any]]:
    """``answer_score.summarise`` per (scheme, rho, mode), with the report's older fields kept."""
    out = summarise(rows, reference)
    by_key: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault((row["scheme"], row["rho"], row["mode"]), []).append(row)
    for entry in out:
        group = by_key[(entry["scheme"], entry["rho"], entry["mode"])]
        entry["f1_gold"], entry["f1_gold_ci95"] = entry["f1"], entry["f1_ci95"]
        entry["f1_full"] = float(np.mean([r["f1_full"] for r in group]))
        entry["correct"] = int(sum(r["correct"] for r in group))
    return out
