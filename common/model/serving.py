"""Serving chat and text completions on top of a stored prefix cache: prefill only the tokens the cache does
not hold, then sample token by token (the OpenAI face of both daemons, ``common/node/openai/http.py``).

A stored cache is a ``PartialKV``: a handed-off one keeps its row masks (mask mode), so the new tokens
attend only to the rows that arrived (``attention.pfec_sdpa``), at their original positions. A stored entry
is never written: the request's cache is a copy of its first ``n_cached`` rows, extended with the suffix,
and what the request leaves behind (prompt + the tokens it fed) becomes a new entry of its own.

Runs in the model worker thread (one request at a time); ``on_text`` is called there with each piece of
text as it is sampled (the HTTP layer hops it to the event loop).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from pfec.common.model.constrained import Compiled
from pfec.common.model.constrained import GrammarError as GrammarError  # the OpenAI face catches it here
from pfec.common.model.decode import batch_cache, forward_rows, stop_token_ids
from pfec.common.model.kvcache import PartialKV
from pfec.common.model.loading import ModelRuntime, check_length
from pfec.common.model.prompts import tokenizer_of

# A rendered stop string may end inside a token: text this close to the end is held back until the next
# token says whether a stop string starts there.
_REPLACEMENT = "\ufffd"  # a token that ends inside a UTF-8 character decodes to this until the rest comes


@dataclass(frozen=True)
class Sampling:
    """How to pick each token: greedy at temperature 0, else nucleus sampling from a seeded generator; with
    a grammar, only among the tokens it allows (``constrained``), and the reply ends when it is complete."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: Compiled | None = None


@dataclass
class Completion:
    """What one request produced, and the cache it leaves (prompt + every token fed)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # stop (end of turn or a stop string) or length
    prompt_tokens: int
    cached_tokens: int
    kv: PartialKV  # over ``fed_ids``
    fed_ids: list[int]
    ttft_s: float  # from the job's start to the first token sampled (suffix prefill included)
    prefill_s: float


def chat_ids(runtime: ModelRuntime, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Messages (and tools, when the template takes them) rendered with the model's own chat template, as
    token ids."""
    tok = tokenizer_of(runtime)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"model {runtime.model_id!r} has no chat template: use /v1/completions")
    offered = [dict(t) for t in tools] if tools else None
    text = tok.apply_chat_template([dict(m) for m in messages], tools=offered, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)
    return list(tok(text, add_special_tokens=False).input_ids)


_PROBE_TOOL = {"type": "function", "function": {"name": "pfec_probe", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


def takes_tools(runtime: ModelRuntime) -> bool:
    """Whether the model's chat template renders tools itself: a probe conversation rendered with and
    without a tool differs (SmolLM2's template ignores them). Remembered per template."""
    tok = tokenizer_of(runtime)
    template = getattr(tok, "chat_template", None)
    if not template:
        return False
    known = _TAKES_TOOLS.get(str(template))
    if known is None:
        probe = [{"role": "user", "content": "hi"}]
        try:
            plain = tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
            offered = tok.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False,
                                              add_generation_prompt=True)
        except Exception:  # a template that fails on tools does not take them
            offered = plain = ""
        known = _TAKES_TOOLS[str(template)] = plain != offered
    return known


_TAKES_TOOLS: dict[str, bool] = {}


def text_ids(runtime: ModelRuntime, text: str) -> list[int]:
    """A raw prompt's token ids (``/v1/completions``)."""
    return list(tokenizer_of(runtime)(text, add_special_tokens=False).input_ids)


def kv_nbytes(kv: PartialKV) -> int:
    """Bytes the cache's tensors (and masks) hold."""
    total = sum(t.numel() * t.element_size() for t in (*kv.keys, *kv.values))
    masks = kv.row_masks or []
    return int(total + sum(m.numel() * m.element_size() for m in masks if m is not None))


def crop(kv: PartialKV, n_tokens: int) -> PartialKV:
    """The first ``n_tokens`` rows (views: nothing copied, nothing written)."""
    if not 0 < n_tokens <= kv.n_context:
        raise ValueError(f"crop to {n_tokens} tokens of a {kv.n_context}-token cache")
    masks = None if kv.row_masks is None else [None if m is None else m[:, :n_tokens] for m in kv.row_masks]
    return PartialKV([k[:, :, :n_tokens] for k in kv.keys], [v[:, :, :n_tokens] for v in kv.values], masks,
                     n_tokens, kv.mode)


def complete(runtime: ModelRuntime, prompt_ids: Sequence[int], prefix: PartialKV | None, n_cached: int,
             sampling: Sampling, on_text: Callable[[str], None] | None = None) -> Completion:
    """Prefill ``prompt_ids[n_cached:]`` on a copy of ``prefix``'s first ``n_cached`` rows (all of the prompt
    without a prefix), then sample up to ``sampling.max_tokens`` tokens; ``on_text`` gets each new piece of
    text (stop strings never reach it)."""
    if not 0 <= n_cached < len(prompt_ids) or (n_cached and prefix is None):
        raise ValueError(f"{n_cached} cached tokens of a {len(prompt_ids)}-token prompt")
    check_length(runtime, len(prompt_ids), sampling.max_tokens)
    started = time.perf_counter()
    base = crop(prefix, n_cached) if prefix is not None and n_cached else None
    with torch.inference_mode():
        cache, masks, logits = start_cache(runtime, base, prompt_ids[n_cached:], n_cached,
                                           sampling.max_tokens)
        prefill_s = time.perf_counter() - started
        decoded = _Decoder(runtime, sampling, on_text)
        fed = list(prompt_ids)
        token = decoded.pick(logits)
        ttft_s = time.perf_counter() - started
        while decoded.take(token):
            fed.append(token)
            logits = forward_rows(runtime, masks, cache, [[token]], len(fed) - 1, last_only=True)
            token = decoded.pick(logits)
    kv = _leftover(cache, None if base is None else base.row_masks, len(fed),
                   base.mode if base is not None else "mask")
    return Completion(decoded.out, decoded.final_text(), decoded.finish_reason, len(prompt_ids), n_cached, kv,
                      fed, ttft_s, prefill_s)


def start_cache(runtime: ModelRuntime, base: PartialKV | None, suffix: Sequence[int], start: int,
           room: int) -> tuple[DynamicCache, list[torch.Tensor | None] | None, torch.Tensor]:
    """A cache with ``room`` rows free after the suffix (each decoded token is then written in place; a
    ``DynamicCache`` concatenates, copying the whole cache per token), the suffix prefilled into it, and
    the last position's logits. The base is copied once into the new buffers, never written."""
    if base is None:
        cache = DynamicCache()
        logits = forward_rows(runtime, None, cache, [list(suffix)], start, last_only=True)
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        kv = PartialKV([k for k, _ in layers], [v for _, v in layers], None, len(suffix), "mask")
        reserved, masks = batch_cache([kv], room)
        return reserved, masks, logits
    reserved, masks = batch_cache([base], len(suffix) + room)
    logits = forward_rows(runtime, masks, reserved, [list(suffix)], start, last_only=True)
    return reserved, masks, logits


def _padded(masks: list[torch.Tensor | None] | None, n: int) -> list[torch.Tensor | None] | None:
    """Row masks grown to ``n`` rows: rows computed here are always available."""
    if masks is None:
        return None
    out: list[torch.Tensor | None] = []
    for mask in masks:
        if mask is None or mask.shape[-1] >= n:
            out.append(mask)
            continue
        grown = torch.ones(mask.shape[0], n, dtype=torch.bool, device=mask.device)
        grown[:, : mask.shape[-1]] = mask
        out.append(grown)
    return out


def _leftover(cache: DynamicCache, masks: list[torch.Tensor | None] | None, n: int, mode: str) -> PartialKV:
    """The first ``n`` rows of the reserved cache, compacted (the room is not kept)."""
    keys = [layer.keys[:, :, :n].clone() for layer in cache.layers]
    values = [layer.values[:, :, :n].clone() for layer in cache.layers]
    return PartialKV(keys, values, _padded(masks, n), n, "zero" if mode == "zero" else "mask")


def extend(runtime: ModelRuntime, ids: Sequence[int], prefix: PartialKV | None, n_cached: int) -> PartialKV:
    """The cache over ``ids``: ``prefix``'s first ``n_cached`` rows (copied) and the rest prefilled here (a
    conversation's cache made whole before it is handed off)."""
    if not 0 <= n_cached <= len(ids) or (n_cached and prefix is None) or not ids:
        raise ValueError(f"{n_cached} cached tokens of {len(ids)}")
    check_length(runtime, len(ids))
    base = crop(prefix, n_cached) if prefix is not None and n_cached else None
    if base is not None and n_cached == len(ids):
        return base
    with torch.inference_mode():
        cache, _, _ = start_cache(runtime, base, ids[n_cached:], n_cached, 0)
    return _leftover(cache, None if base is None else base.row_masks, len(ids),
                     base.mode if base is not None else "mask")


class _Decoder:
    """Token choice, stop conditions and the text handed out so far."""

    def __init__(self, runtime: ModelRuntime, sampling: Sampling,
                 on_text: Callable[[str], None] | None) -> None:
        self.runtime = runtime
        self.sampling = sampling
        self.on_text = on_text
        self.stops = stop_token_ids(runtime)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.out: list[int] = []
        self.sent = 0  # characters of the text handed to on_text
        self.text = ""
        self.finish_reason = "length"
        self.hold = max((len(s) for s in sampling.stop), default=1) - 1
        self.matcher = None if sampling.grammar is None else sampling.grammar.matcher()

    def pick(self, logits: torch.Tensor) -> int:
        if self.matcher is not None:
            self.matcher.restrict(logits[0, -1])  # in place, on the logits' device
        row = logits[0, -1].float().cpu()
        s = self.sampling
        if s.temperature == 0:
            return int(row.argmax())
        probs = torch.softmax(row / s.temperature, dim=-1)
        if s.top_p < 1:
            ordered, index = probs.sort(descending=True)
            keep = ordered.cumsum(0) - ordered < s.top_p  # the smallest head holding top_p of the mass
            probs = torch.zeros_like(probs).scatter(0, index[keep], ordered[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def take(self, token: int) -> bool:
        """Append ``token`` unless it ends the turn; False once the completion is over."""
        if token in self.stops:
            self.finish_reason = "stop"
            self._flush(final=True)
            return False
        self.out.append(token)
        if self.matcher is not None:
            self.matcher.consume(token)
        self.text = str(tokenizer_of(self.runtime).decode(self.out, skip_special_tokens=True))
        cut = _stop_at(self.text, self.sampling.stop)
        if cut is not None or (self.matcher is not None and self.matcher.done):
            self.text = self.text if cut is None else self.text[:cut]
            self.finish_reason = "stop"
            self._flush(final=True)
            return False
        if len(self.out) >= self.sampling.max_tokens:
            self._flush(final=True)
            return False
        self._flush(final=False)
        return True

    def _flush(self, final: bool) -> None:
        end = len(self.text) if final else len(self.text) - self.hold
        while not final and end > self.sent and self.text[end - 1] == _REPLACEMENT:
            end -= 1
        if end > self.sent and self.on_text is not None:
            self.on_text(self.text[self.sent : end])
        self.sent = max(self.sent, end)

    def final_text(self) -> str:
        return self.text


def _stop_at(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string begins in ``text`` (None: none there)."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None
