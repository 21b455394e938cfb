"""Decoding from a handed-off (possibly partial) cache: greedy generation and teacher-forced logits.

The question is fed at its original positions after the context, with the cache's row masks applied, so
the receiver never re-prefills what it was sent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

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
    step_s: float | None = None  # the first decode step after the first token (None: it stopped there)


def _forward(runtime: ModelRuntime, kv: PartialKV, cache: DynamicCache, ids: Sequence[int],
             start: int) -> torch.Tensor:
    return forward_rows(runtime, kv.row_masks, cache, [list(ids)], start)[0]


def forward_rows(runtime: ModelRuntime, masks: Sequence[torch.Tensor | None] | None, cache: DynamicCache,
                  ids: Sequence[Sequence[int]], start: int, last_only: bool = False) -> torch.Tensor:
    """Logits [batch, len, vocab] of feeding ``ids`` (one row per cache of the batch) at ``start``;
    ``last_only``: [batch, 1, vocab], the last position's, which is all greedy decoding reads (the LM head
    over every question position of a batch of 12 cost ~0.28 s of its ~8 s here)."""
    input_ids = torch.tensor([list(row) for row in ids], device=runtime.device)
    position_ids = torch.arange(start, start + input_ids.shape[1], device=runtime.device)[None]
    with row_masks(masks):
        out = runtime.model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True,
                            logits_to_keep=1 if last_only else 0)
    return out.logits


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
    a damaged cache's rambling otherwise costs up to ``max_new_tokens`` forward passes per answer). A batch
    of one: each step writes its row into room reserved after the context, never copying the cache."""
    return generate_batch(runtime, [kv], question_ids, max_new_tokens, first_line_only)[0]


def generate_batch(runtime: ModelRuntime, kvs: Sequence[PartialKV], question_ids: Sequence[int],
                   max_new_tokens: int = 24, first_line_only: bool = False) -> list[Generation]:
    """``generate`` for several caches of one context at once (e.g. one prompt's partial caches).

    One forward pass per step serves the whole batch, so the model's weights are read once per step
    rather than once per cache: decoding a small model on a CPU is bound by those reads. Each row stops
    as ``generate`` would (its tokens are the same up to the rounding of batched matrix products); the
    batch runs until every row has stopped. ``ttft_s`` and ``decode_s`` are the batch's."""
    if not kvs:
        return []
    n_context = kvs[0].n_context
    if any(kv.n_context != n_context for kv in kvs):
        raise ValueError("generate_batch needs caches of one context length")
    check_length(runtime, n_context, len(question_ids) + max_new_tokens)
    stops = stop_token_ids(runtime)
    started = time.perf_counter()
    cache, masks = batch_cache(kvs, len(question_ids) + max_new_tokens)
    outs: list[list[int]] = [[] for _ in kvs]
    active = list(range(len(kvs)))  # batch row -> cache index, for the rows still decoding
    with torch.inference_mode():
        logits = forward_rows(runtime, masks, cache, [question_ids] * len(kvs), n_context, last_only=True)
        next_ids = [int(t) for t in logits[:, -1].argmax(dim=-1)]
        ttft = time.perf_counter() - started + max(kv.rebuild_s for kv in kvs)
        position = n_context + len(question_ids)
        step_s: float | None = None
        while True:
            going = [row for row, i in enumerate(active)
                     if _take(runtime, outs[i], next_ids[row], stops, max_new_tokens, first_line_only)]
            if not going:
                break
            if len(going) < len(active):  # stopped rows leave the batch: no more reads of their cache
                keep = torch.tensor(going, device=runtime.device)
                cache.batch_select_indices(keep)
                masks = None if masks is None else [None if m is None else m[keep] for m in masks]
                active, next_ids = [active[r] for r in going], [next_ids[r] for r in going]
            stepped = time.perf_counter()
            logits = forward_rows(runtime, masks, cache, [[t] for t in next_ids], position)
            next_ids = [int(t) for t in logits[:, -1].argmax(dim=-1)]
            if step_s is None:
                step_s = time.perf_counter() - stepped
            position += 1
    decode_s = time.perf_counter() - started
    return [Generation(tuple(out), _text(runtime, out), ttft, decode_s, step_s) for out in outs]


def _take(runtime: ModelRuntime, out: list[int], next_id: int, stops: set[int], max_new_tokens: int,
          first_line_only: bool) -> bool:
    """Append ``next_id`` to a row as ``generate`` would; whether the row goes on."""
    if next_id in stops or len(out) >= max_new_tokens:
        return False
    out.append(next_id)
    return not (len(out) == max_new_tokens or (first_line_only and _ends_first_line(runtime, out)))


def _text(runtime: ModelRuntime, out: Sequence[int]) -> str:
    if runtime.tokenizer is None:
        return ""
    return str(runtime.tokenizer.decode(list(out), skip_special_tokens=True)).strip()


class _ReservedLayer(DynamicLayer):  # type: ignore[misc]  # transformers is untyped here
    """A cache layer whose keys and values are views of buffers with room for the question and answer.

    ``DynamicLayer`` concatenates on every step, copying the whole cache to add one row; for a batch of
    caches that copy cost more than the attention itself. Here a step writes its rows in place."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], room: int) -> None:
        super().__init__()
        _, heads, n, dim = keys[0].shape
        self._keys = keys[0].new_empty(len(keys), heads, n + room, dim)
        self._values = values[0].new_empty(len(values), heads, n + room, values[0].shape[-1])
        for row, (k, v) in enumerate(zip(keys, values, strict=True)):
            self._keys[row, :, :n], self._values[row, :, :n] = k[0], v[0]
        self.device, self.is_initialized = self._keys.device, True
        self._show(n)

    def _show(self, n: int) -> None:
        self.keys, self.values = self._keys[:, :, :n], self._values[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n, new = self.get_seq_length(), key_states.shape[-2]
        if n + new > self._keys.shape[2]:  # out of room: grow (not expected: the room is reserved)
            self._keys = torch.cat([self.keys, key_states], dim=-2)
            self._values = torch.cat([self.values, value_states], dim=-2)
        else:
            self._keys[:, :, n : n + new], self._values[:, :, n : n + new] = key_states, value_states
        self._show(n + new)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        n = self.get_seq_length()
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._show(n)


def batch_cache(kvs: Sequence[PartialKV],
                 room: int) -> tuple[DynamicCache, list[torch.Tensor | None] | None]:
    """One cache holding every cache as a batch row (``room`` rows free for what decoding adds), and
    per-layer [batch, heads, tokens] row masks (None for a layer no row masks; an unmasked row of a
    masked layer attends to every row)."""
    n_layers = len(kvs[0].keys)
    layers = [_ReservedLayer([kv.keys[i] for kv in kvs], [kv.values[i] for kv in kvs], room)
              for i in range(n_layers)]
    cache = DynamicCache()
    cache.layers = layers
    if all(kv.row_masks is None for kv in kvs):
        return cache, None
    masks: list[torch.Tensor | None] = []
    for layer in range(n_layers):
        rows = [None if kv.row_masks is None else kv.row_masks[layer] for kv in kvs]
        if all(r is None for r in rows):
            masks.append(None)
            continue
        shape = kvs[0].keys[layer].shape[1:3]  # (KV heads, context tokens)
        device = kvs[0].keys[layer].device
        masks.append(torch.stack([torch.ones(shape, dtype=torch.bool, device=device) if r is None else r
                                  for r in rows]))
    return cache, masks


def teacher_forced_logits(runtime: ModelRuntime, kv: PartialKV, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32) of feeding ``token_ids`` after the (partial) context."""
    with torch.inference_mode():
        return _forward(runtime, kv, kv.fresh_cache(), token_ids, kv.n_context).float()


def local_answer(runtime: ModelRuntime, prompt: HandoffPrompt, max_new_tokens: int = 24) -> Generation:
    """The sender's own full-KV answer (prefill + question on its own cache, no transfer)."""
    cache, _ = prefill(runtime, prompt.context_ids)
    return generate(runtime, partial_from_cache(cache, None, "mask"), prompt.question_ids, max_new_tokens)
