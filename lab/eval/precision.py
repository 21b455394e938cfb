"""`pfec eval` fidelity stage: needle-QA answers from the KV cache each precision variant delivers, scored.

Why: a quantised stream delivers more of the cache by the deadline at lower fidelity per block; only the
answers say whether the trade pays. For each prompt (``workloads.needle_suite``, the task stage's
short-answer prompting), each deadline rho (relative to the NATIVE cache's serialisation, main GE config)
and each variant, the real sessions run in simulated time (``lab/sim/``: prompt i meets loss realization
i under every variant, so the comparison is paired); the receiver's cache is rebuilt from what arrived:
native blocks as they are, quantised pieces dequantised at the level their arrived pieces reach, a split's
computed front exact (the sender's own prefix KV: a prefix's KV does not depend on what follows), the rest
masked. The answer is generated greedily and scored (``kv.answer_score``): agreement with the full-KV answer
and gold accuracy (gold contained), with paired bootstrap CIs of each variant's difference to native.

Variants (``PRECISION_VARIANTS``): ``native`` (priorityfec at native precision, the reference), each fixed
mix, ``auto`` (the break-even planner's, ``mode_choice.choose_mix``) and ``split`` (the receiver prefills the
front up to the planner's meeting point while the back streams at the planner's split mix). The full-KV
cache is computed once per prompt; identical deliveries share one generation. This module loads torch.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache

from pfec.common.model import llm
from pfec.common.plan.kvlayout import FRAGMENT_ID_SIZE
from pfec.common.plan.mode_choice import choose_mix, choose_mode, handoff_deadline_s
from pfec.common.plan.precision import Level, PiecePlan
from pfec.common.plan.utility import UtilityProfile
from pfec.lab.eval.config import (
    NAMED_CONFIGS,
    PRECISION_RHOS,
    PRECISION_VARIANTS,
    REFERENCE_VARIANT,
    EvalConfig,
)
from pfec.lab.eval.task import (
    MODEL_WORKER,
    AnswerBatch,
    _score_answer,
    map_prompts,
    prefilled,
    short_answer_prompt,
)
from pfec.lab.kv.answer_score import paired_difference
from pfec.lab.kv.retention import blocks_available
from pfec.lab.kv.workloads import SHORT_ANSWER_SYSTEM, QAExample, needle_suite
from pfec.lab.reporting.progress import StageProgress
from pfec.lab.sim.channel import LossModel, parse_loss_spec
from pfec.lab.sim.simulate import Handoff, RunResult, prepare, run_scheme

__all__ = ["PRECISION_RHOS", "PRECISION_VARIANTS", "precision_scores", "precision_summary"]

REFERENCE: Final = REFERENCE_VARIANT
SCHEME: Final = "priorityfec"
METRICS: Final = ("agreement", "contained")  # equal to the full-KV answer; gold accuracy
MODE: Final = "mask"


@dataclass(frozen=True)
class Variant:
    """How one variant hands off a context: the mix streamed, the mode and a split's meeting token."""

    name: str
    mix: str
    mode: str = "handoff"
    meeting_token: int | None = None


def resolve_variant(name: str, n_tokens: int, runtime: llm.ModelRuntime, cfg: EvalConfig,
                    rho: float | None = None) -> Variant:
    """``auto`` and ``split`` from the break-even planner for this context, link and deadline (``rho``:
    fidelity first, the most faithful option that starts by it); a mix as itself."""
    rate_bps, rtt_s = cfg.rate_mbps * 1e6, cfg.rtt_ms / 1000
    deadline_s = handoff_deadline_s(n_tokens, runtime.geometry, rate_bps, rtt_s / 2, rho)
    if name == "auto":
        mix, _view = choose_mix("auto", n_tokens, runtime.geometry, rate_bps, rtt_s, deadline_s=deadline_s)
        return Variant(name, mix)
    if name == "split":
        choice = choose_mode("split", "auto", n_tokens, runtime.geometry, rate_bps, rtt_s,
                             deadline_s=deadline_s)
        assert choice.mix is not None and choice.meeting_token is not None
        return Variant(name, choice.mix, "split", choice.meeting_token)
    if name not in PRECISION_VARIANTS:
        raise ValueError(f"precision variant {name!r} is not one of {', '.join(PRECISION_VARIANTS)}")
    return Variant(name, name)


def precision_scores(cfg: EvalConfig, rhos: Sequence[float] = PRECISION_RHOS,
                     variants: Sequence[str] = PRECISION_VARIANTS, prompts: int | None = None,
                     progress: StageProgress | None = None,
                     checkpoint: Callable[[dict[str, Any]], None] | None = None,
                     prefill_store: Path | None = None) -> dict[str, Any]:
    """Rows per (prompt, rho, variant), their paired summaries and the stage's timings; ``checkpoint``
    gets the result so far after every prompt (a long run leaves what it has). Prompts are spread over
    ``cfg.jobs`` spawned processes with one torch thread each, as in the task stage; the timings are then
    summed over the processes (CPU-seconds of each part, not wall time). ``prefill_store``: where the task
    stage of the same run left the prompts' prefilled caches (``eval_task.prefilled``)."""
    started = time.perf_counter()
    for name in variants:
        if name not in PRECISION_VARIANTS:
            raise ValueError(f"precision variant {name!r} is not one of {', '.join(PRECISION_VARIANTS)}")
    runtime = llm.load_model("default", device="cpu")
    n_prompts = cfg.precision_prompts if prompts is None else prompts
    examples = needle_suite(n_prompts, cfg.context_tokens, cfg.seed, split="eval",
                            count_tokens=partial(llm.count_tokens, runtime))
    job: _Job = (cfg, tuple(rhos), tuple(variants), prefill_store)
    timer = _Timer()
    rows: list[dict[str, Any]] = []
    full_rows: list[dict[str, Any]] = []
    resolved: dict[str, dict[str, Any]] = {}
    meeting: dict[str, dict[int, int | None]] = {}
    total = len(examples) * len(rhos) * len(variants)
    for done in map_prompts(cfg.jobs, cfg, partial(_prompt_rows, job), list(enumerate(examples))):
        full_rows.append(done.full_row)
        rows += done.rows
        for name, (mix, mode, token) in done.variants.items():
            resolved.setdefault(name, {"mix": mix, "mode": mode, "meeting_tokens": []})
            meeting.setdefault(name, {})[int(done.full_row["prompt"])] = token
        timer.add(done.seconds, done.counts)
        if progress is not None:
            progress("precision score", len(rows), total)
        if checkpoint is not None:
            checkpoint(_result(rows, full_rows, variants, rhos, resolved, timer, started, runtime, cfg,
                               len(examples)))
    full_rows.sort(key=lambda r: int(r["prompt"]))
    rows.sort(key=lambda r: int(r["prompt"]))  # a one-process run's order, whatever finished first
    for name, by_prompt in meeting.items():
        resolved[name]["meeting_tokens"] = [by_prompt[p] for p in sorted(by_prompt)]
    return _result(rows, full_rows, variants, rhos, resolved, timer, started, runtime, cfg, len(examples))


_Job = tuple[EvalConfig, tuple[float, ...], tuple[str, ...], Path | None]
@dataclass
class _PromptDone:
    full_row: dict[str, Any]
    rows: list[dict[str, Any]]
    variants: dict[str, tuple[str, str, int | None]]  # name -> (mix, mode, meeting token)
    seconds: dict[str, float]
    counts: dict[str, int]


def _prompt_rows(job: _Job, item: tuple[int, QAExample]) -> _PromptDone:
    """One prompt: its full-KV answer, then every variant at every rho (identical runs shared)."""
    cfg, rhos, variants, store = job
    i, example = item
    runtime: llm.ModelRuntime = MODEL_WORKER["runtime"]
    profile: UtilityProfile = MODEL_WORKER["profile"]
    loss = parse_loss_spec(cfg.main_loss_spec())
    timer = _Timer()
    with timer("prefill"):
        context_ids, question_ids = short_answer_prompt(runtime, example)
        cache = prefilled(runtime, context_ids, store)
    with timer("generate"):
        full = llm.generate(runtime, llm.partial_from_cache(cache, None, MODE), question_ids,
                            cfg.max_new_tokens, first_line_only=True)
    scored = _score_answer(full.text, example.answers, None)
    full_row = {"prompt": i, **example.meta, **scored}
    run = _PromptRun(cfg, runtime, cache, question_ids, i, example, str(scored["answer"]), timer)
    runs: dict[tuple[Variant, float], tuple[Handoff, RunResult]] = {}  # auto is often a fixed mix
    rows: list[dict[str, Any]] = []
    chosen: dict[str, tuple[str, str, int | None]] = {}
    for name in variants:
        mixes: list[str] = []  # auto and split may choose per rho
        for rho in rhos:
            variant = resolve_variant(name, len(context_ids), runtime, cfg, rho)
            if variant.mix not in mixes:
                mixes.append(variant.mix)
            chosen[name] = ("/".join(mixes), variant.mode, variant.meeting_token)
            same = (replace(variant, name=""), rho)
            if same not in runs:
                with timer("simulate"):
                    handoff = _handoff(cfg, loss, rho, profile, runtime, len(context_ids), variant)
                    runs[same] = handoff, run_scheme(handoff, SCHEME, i, verify=False)
            handoff, result = runs[same]
            rows.append({"prompt": i, "rho": rho, "variant": name, "mix": variant.mix,
                         "mode": variant.mode, **run.score(handoff, result)})
    run.answers.fill(rows)
    timer.counts["answers"] = run.answers.generated + 1  # and the full-KV answer
    return _PromptDone(full_row, rows, chosen, timer.seconds, timer.counts)


def _result(rows: list[dict[str, Any]], full_rows: list[dict[str, Any]], variants: Sequence[str],
            rhos: Sequence[float], resolved: dict[str, dict[str, Any]], timer: _Timer, started: float,
            runtime: llm.ModelRuntime, cfg: EvalConfig, n_prompts: int) -> dict[str, Any]:
    return {
        "rows": rows,
        "full_kv": full_rows,
        "summary": precision_summary(rows, variants, rhos),
        "variants": resolved,
        "timing_s": {**timer.seconds, "total": time.perf_counter() - started},
        "generations": timer.counts.get("answers", 0),
        "inputs": {
            "model": runtime.model_id, "prompts": n_prompts, "prompts_done": len(full_rows), "scheme": SCHEME,
            "workload": "needle_suite (kinds x depths balanced, one essay per prompt)",
            "prompting": {"system": SHORT_ANSWER_SYSTEM, "answer_prefix": "the needle's stem"},
            "context_tokens": cfg.context_tokens, "loss": NAMED_CONFIGS["main"], "rhos": list(rhos),
            "rho_of": "native-dtype serialisation of the whole cache", "variants": list(variants),
            "reconstruction": MODE, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
            "rate_mbps": cfg.rate_mbps, "rtt_ms": cfg.rtt_ms, "reference": REFERENCE,
            "processes": max(1, min(cfg.jobs, n_prompts)),
            "timing": "CPU-seconds per part, summed over processes",
        },
    }


def _handoff(cfg: EvalConfig, loss: LossModel, rho: float, profile: UtilityProfile, runtime: llm.ModelRuntime,
             n_tokens: int, variant: Variant) -> Handoff:
    """The simulator's handoff of this prompt's context (the model's geometry and block plan)."""
    sim = replace(cfg.sim_config(loss, rho, profile, precision=variant.mix), tokens=n_tokens,
                  geometry=runtime.geometry, max_symbol_size=llm.MAX_SYMBOL_SIZE, mode=variant.mode,
                  meeting_token=variant.meeting_token)
    return prepare(sim)


class _Timer:
    """Seconds and calls per part of the stage (what dominates its time)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, part: str) -> _Span:
        return _Span(self, part)

    def add(self, seconds: dict[str, float], counts: dict[str, int]) -> None:
        for part, value in seconds.items():
            self.seconds[part] = self.seconds.get(part, 0.0) + value
        for part, count in counts.items():
            self.counts[part] = self.counts.get(part, 0) + count


class _Span:
    def __init__(self, timer: _Timer, part: str) -> None:
        self.timer, self.part, self.t0 = timer, part, 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *_exc: object) -> None:
        t = self.timer
        t.seconds[self.part] = t.seconds.get(self.part, 0.0) + time.perf_counter() - self.t0
        t.counts[self.part] = t.counts.get(self.part, 0) + 1


class _PromptRun:
    """One prompt: its full cache, each stream's quantised symbols (once per plan), and the answers by
    delivered state (the same delivery gives the same answer whatever variant delivered it)."""

    def __init__(self, cfg: EvalConfig, runtime: llm.ModelRuntime, cache: DynamicCache,
                 question_ids: Sequence[int], index: int, example: QAExample, reference: str,
                 timer: _Timer) -> None:
        self.cfg, self.runtime, self.cache, self.question_ids = cfg, runtime, cache, question_ids
        self.index, self.example, self.reference, self.timer = index, example, reference, timer
        self.symbols: dict[bytes, npt.NDArray[np.uint8]] = {}
        score = partial(_score_answer, golds=example.answers, reference=reference)
        self.answers = AnswerBatch(runtime, question_ids, cfg.max_new_tokens, score, timed=timer)

    def score(self, handoff: Handoff, result: RunResult) -> dict[str, Any]:
        stream = handoff.stream("utility")
        if stream is None:
            kept = np.flatnonzero(result.recovered_blocks)
            key = b"native" + hashlib.sha1(kept.tobytes()).digest()
            answer = self.answers.request(key, partial(self._native_kv, handoff, kept))
            levels = {"native": len(kept), "none": int(handoff.plan.n_blocks - len(kept))}
        else:
            have = np.zeros(stream.n_symbols, dtype=np.bool_)
            if result.decoded_ids is not None:
                have[result.decoded_ids] = True
            block_levels, bases = stream.usable(have)
            computed = result.computed_tokens if handoff.config.mode == "split" else 0
            digest = hashlib.sha1(block_levels.tobytes() + bases.tobytes() + str(computed).encode()).digest()
            key = handoff.config.precision.encode() + b"/" + str(handoff.meeting_token).encode() + digest
            answer = self.answers.request(key, partial(self._stream_kv, handoff, stream, have, block_levels,
                                                       bases, computed))
            values, counts = np.unique(block_levels, return_counts=True)
            levels = {Level(int(v)).label: int(c) for v, c in zip(values, counts, strict=True)}
        return {"recovered_utility": result.recovered_utility, "computed_tokens": result.computed_tokens,
                "start_s": result.start_s, "levels": levels, "answer_key": answer}

    def _native_kv(self, handoff: Handoff, kept: npt.NDArray[np.int64]) -> llm.PartialKV:
        plan = handoff.plan
        available = torch.from_numpy(blocks_available(plan, kept)).to(self.runtime.device)
        return llm.partial_from_cache(self.cache, available, MODE, plan.n_tokens)

    def _stream_kv(self, handoff: Handoff, stream: PiecePlan, have: npt.NDArray[np.bool_],
                   levels: npt.NDArray[np.int8], bases: npt.NDArray[np.int8], computed: int) -> llm.PartialKV:
        key = handoff.config.precision.encode() + b"/" + str(handoff.meeting_token).encode()
        if key not in self.symbols:
            with self.timer("quantise"):
                self.symbols[key] = llm.serialise_stream(self.runtime, self.cache, stream)
        store = np.ascontiguousarray(self.symbols[key][:, FRAGMENT_ID_SIZE:])
        store[~have] = 0  # what did not arrive is not there
        kv = llm.rebuild_from_stream(self.runtime, stream, store, levels, bases, MODE)
        if computed:
            kv = llm.join_prefix(kv, self.cache, computed)
        return kv


def precision_summary(rows: Sequence[dict[str, Any]], variants: Sequence[str],
                      rhos: Sequence[float]) -> list[dict[str, Any]]:
    """Per (variant, rho): n, each metric's mean, mean credited utility, and each metric's paired
    difference to ``native`` on the same prompts (bootstrap 95% CI over prompts)."""
    by_key: dict[tuple[str, float], dict[int, dict[str, Any]]] = {}
    for row in rows:
        by_prompt = by_key.setdefault((str(row["variant"]), float(row["rho"])), {})
        if int(row["prompt"]) in by_prompt:
            raise ValueError(f"prompt {row['prompt']} scored twice for {row['variant']} at rho {row['rho']}")
        by_prompt[int(row["prompt"])] = row
    out = []
    for rho in rhos:
        ref = by_key.get((REFERENCE, float(rho)))
        for name in variants:
            group = by_key.get((name, float(rho)))
            if not group:
                continue
            entry: dict[str, Any] = {"variant": name, "rho": float(rho), "n": len(group),
                                     "mix": next(iter(group.values()))["mix"]}
            for metric in METRICS:
                entry[metric] = float(np.mean([r[metric] for r in group.values()]))
            entry["recovered_utility"] = float(np.mean([r["recovered_utility"] for r in group.values()]))
            if ref is not None and name != REFERENCE:
                entry[f"vs_{REFERENCE}"] = {
                    metric: paired_difference({p: float(r[metric]) for p, r in group.items()},
                                              {p: float(r[metric]) for p, r in ref.items()})
                    for metric in METRICS
                }
            out.append(entry)
    return out
