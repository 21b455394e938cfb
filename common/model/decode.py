"""Decoding from a handed-off (possibly partial) cache: greedy generation and teacher-forced logits.

The question is fed at its original positions after the context, with the cache's row masks applied, so
the receiver never re-prefills what it was sent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pfec.common.model.attention import row_masks
from pfec.common.model.kvcache import PartialKV, partial_from_cache, prefill
from pfec.common.model.loading import ModelRuntime, check_length
from pfec.common.model.prompts import HandoffPrompt

_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    text: str
    ttft_s: float  # rebuild + first forward over the question, to the first token
    decode_s: float


def _forward(runtime: ModelRuntime, kv: PartialKV, cache: DynamicCache, ids: Sequence[int],
             start: int) -> torch.Tensor:
    input_ids = torch.tensor([list(ids)], device=runtime.device)
    position_ids = torch.arange(start, start + len(ids), device=runtime.device)[None]
    with row_masks(kv.row_masks):
        out = runtime.model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)
    return out.logits[0]


def stop_token_ids(runtime: ModelRuntime) -> set[int]:
    """End-of-sequence and end-of-turn token ids the tokenizer knows (none without a tokenizer)."""
    tok = runtime.tokenizer
    if tok is None:
        return set()
    stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for name in _STOP_TOKENS:
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != getattr(tok, "unk_token_id", None):
            stops.add(tid)
    return stops


def _ends_first_line(runtime: ModelRuntime, out: list[int]) -> bool:
    """Whether the text so far holds a complete non-empty first line (a newline after some text)."""
    if runtime.tokenizer is None:
        return False
    text = runtime.tokenizer.decode(out, skip_special_tokens=True).lstrip()
    return "\n" in text


def generate(runtime: ModelRuntime, kv: PartialKV, question_ids: Sequence[int],
             max_new_tokens: int = 24, first_line_only: bool = False) -> Generation:
    """Greedy decode from a handed-off cache: feed the question at its original positions, no re-prefill.

    ``first_line_only``: stop once the first non-empty line is complete (what a short-answer score reads;
    a damaged cache's rambling otherwise costs up to ``max_new_tokens`` forward passes per answer)."""
    check_length(runtime, kv.n_context, len(question_ids) + max_new_tokens)
    stops = stop_token_ids(runtime)
    started = time.perf_counter()
    cache = kv.fresh_cache()
    out: list[int] = []
    with torch.inference_mode():
        logits = _forward(runtime, kv, cache, question_ids, kv.n_context)
        next_id = int(logits[-1].argmax())
        ttft = time.perf_counter() - started + kv.rebuild_s
        position = kv.n_context + len(question_ids)
        while next_id not in stops and len(out) < max_new_tokens:
            out.append(next_id)
            if len(out) == max_new_tokens or (first_line_only and _ends_first_line(runtime, out)):
                break
            next_id = int(_forward(runtime, kv, cache, [next_id], position)[-1].argmax())
            position += 1
    text = runtime.tokenizer.decode(out, skip_special_tokens=True) if runtime.tokenizer is not None else ""
    return Generation(tuple(out), text.strip(), ttft, time.perf_counter() - started)


def teacher_forced_logits(runtime: ModelRuntime, kv: PartialKV, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32) of feeding ``token_ids`` after the (partial) context."""
    with torch.inference_mode():
        return _forward(runtime, kv, kv.fresh_cache(), token_ids, kv.n_context).float()


def local_answer(runtime: ModelRuntime, prompt: HandoffPrompt, max_new_tokens: int = 24) -> Generation:
    """The sender's own full-KV answer (prefill + question on its own cache, no transfer)."""
    cache, _ = prefill(runtime, prompt.context_ids)
    return generate(runtime, partial_from_cache(cache, None, "mask"), prompt.question_ids, max_new_tokens)
