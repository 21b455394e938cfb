"""Constrained decoding: a reply held to a grammar token by token, with llguidance (the grammar library
vLLM, SGLang and llama.cpp use beside xgrammar; docs/ARCHITECTURE.md says why this one).

- ``Grammar`` says what a reply may be: JSON text matching a JSON Schema (``content``), and/or tool calls,
  each ``open`` + JSON matching ``call`` + ``close`` (one, or one or more with ``parallel``), a newline
  between them and at most one after (a model that ends its calls with one may still stop there). The
  node builds it from ``response_format`` and ``tool_choice`` (``common/node/openai/structured.py``);
  the Hermes tags are the node's, the Lark grammar written from them is made here.
- ``compile_grammar`` turns it into a ``Compiled`` grammar for the runtime's tokenizer, cached per grammar
  in a bounded LRU (``CACHE_ENTRIES``); a grammar the library cannot build is a ``GrammarError``.
- Each request copies the compiled matcher (``Compiled.matcher``). Before each token the matcher fills a
  bitmask of the tokens allowed next; ``TokenMask.apply`` sets the others to -inf in the logits row, in
  place, through buffers made once per request (no per-token tensors).

JSON is written as ``json.dumps`` writes it (", " and ": ", no newlines): whitespace is not free, so a
constrained reply cannot pad itself with blank lines until ``max_tokens``.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from pfec.common.model.decode import stop_token_ids
from pfec.common.model.loading import ModelRuntime
from pfec.common.model.prompts import tokenizer_of

LIBRARY = f"llguidance {llguidance.__version__}"
CACHE_ENTRIES = 64  # compiled grammars kept per tokenizer (least recently used dropped first)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The library's own bounds on a grammar and on each token's mask (its defaults, named here): the lexer's
# build and per-token fuel, Earley items per token, the grammar's size. Errors stay short (no parser dump).
_LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                    step_max_items=50_000, max_grammar_size=500_000, verbose_errors=False)
# byte -> the 8 tokens it covers that are NOT allowed (bit i of a little-endian bitmask word is token i).
_BLOCKED_BY_BYTE = ~np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                  bitorder="little").astype(bool)


class GrammarError(ValueError):
    """A grammar the library cannot build, or a matcher that failed while decoding."""


@dataclass(frozen=True)
class Grammar:
    """What a reply may be. ``content``: a JSON Schema (as JSON text) the whole reply matches. ``call``: a
    JSON Schema one call's body matches, written between ``open`` and ``close``; one call, or one or more
    separated by a newline with ``parallel``. Both set: either. Hashable: the cache's key."""

    content: str | None = None
    call: str | None = None
    open: str = ""
    close: str = ""
    parallel: bool = False

    def lark(self) -> str:
        """The grammar in llguidance's Lark dialect (``%json`` embeds a JSON Schema)."""
        starts, rules = [], []
        if self.content is not None:
            starts.append("content")
            rules.append(f"content: %json {_with_options(self.content)}")
        if self.call is not None:
            starts.append("calls")
            rules.append('calls: call ("\\n" call)* "\\n"?' if self.parallel else 'calls: call "\\n"?')
            rules.append(f"call: {json.dumps(self.open)} body {json.dumps(self.close)}")
            rules.append(f"body: %json {_with_options(self.call)}")
        if not starts:
            raise GrammarError("a grammar needs content or calls")
        return "\n".join([f"start: {' | '.join(starts)}", *rules])


def _with_options(schema: str) -> str:
    """The schema with the JSON layout options at its root (``x-guidance``: the library's own key)."""
    value = json.loads(schema)
    if isinstance(value, dict):
        value = {**value, "x-guidance": JSON_OPTIONS}
    return json.dumps(value, ensure_ascii=False)


class TokenMask:
    """Buffers for one sequence's token mask, made once: the library fills ``bitmask`` (one bit per token,
    int32 words, [1, words] as both libraries take it); ``apply`` unpacks it through a byte table into a
    boolean buffer and sets the blocked tokens' logits to -inf in place."""

    def __init__(self, n_vocab: int) -> None:
        words = (n_vocab + 31) // 32
        self.bitmask = torch.full((1, words), -1, dtype=torch.int32)
        self.nbytes = words * 4
        self._bytes = self.bitmask.numpy().reshape(-1).view(np.uint8)
        self._blocked = torch.empty(words * 32, dtype=torch.bool)
        self._blocked8 = self._blocked.numpy().reshape(-1, 8)
        self._vocab = self._blocked[:n_vocab]  # the view a row of the model's vocabulary takes
        self._on_device: torch.Tensor | None = None

    def apply(self, row: torch.Tensor) -> None:
        """``row``: one position's logits [vocab] (a view of the model's output), written in place."""
        np.take(_BLOCKED_BY_BYTE, self._bytes, axis=0, out=self._blocked8)
        n = row.shape[-1]
        blocked = self._vocab if n == self._vocab.shape[0] else self._blocked[:n]
        if row.device.type != "cpu":  # one copy into a buffer on the logits' device
            if self._on_device is None or self._on_device.device != row.device:
                self._on_device = torch.empty_like(blocked, device=row.device)
            blocked = self._on_device.copy_(blocked, non_blocking=True)
        row.masked_fill_(blocked, float("-inf"))


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self.mask = TokenMask(n_vocab)

    def restrict(self, row: torch.Tensor) -> None:
        """Set every token the grammar does not allow next to -inf in ``row``, in place."""
        self._matcher.unsafe_compute_mask_ptr(self.mask.bitmask.data_ptr(), self.mask.nbytes)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._matcher.get_error()}")
        self.mask.apply(row)

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar allows nothing more (only the end of the reply)."""
        return bool(self._matcher.is_stopped())


class Compiled:
    """A grammar compiled for one tokenizer: the matcher each request copies."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self.n_vocab = n_vocab

    def matcher(self) -> Matcher:
        return Matcher(self._matcher.deep_copy(), self.n_vocab)


@dataclass
class _State:
    """Per tokenizer: the library's view of it and the compiled grammars."""

    tokenizer: llguidance.LLTokenizer
    n_vocab: int
    cache: OrderedDict[Grammar, Compiled]
    hits: int = 0
    misses: int = 0


_STATES: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _state(runtime: ModelRuntime) -> _State:
    tok = tokenizer_of(runtime)
    with _LOCK:
        state = _STATES.get(tok)
        if state is None:  # ~0.5 s once per tokenizer (the library reads the whole vocabulary)
            n_vocab = max(int(runtime.model.config.vocab_size), len(tok))
            try:
                lltok = llguidance.hf.from_tokenizer(tok, n_vocab=n_vocab,
                                                     eos_token=sorted(stop_token_ids(runtime)))
            except (ValueError, TypeError) as exc:  # a slow (Python) tokenizer: the library takes fast ones
                raise GrammarError(f"constrained decoding needs a fast tokenizer: {exc}") from None
            state = _STATES[tok] = _State(lltok, n_vocab, OrderedDict())
        return state


def compile_grammar(runtime: ModelRuntime, grammar: Grammar) -> Compiled:
    """The compiled grammar (cached per grammar, per tokenizer); GrammarError when it cannot be built."""
    state = _state(runtime)
    with _LOCK:
        found = state.cache.get(grammar)
        if found is not None:
            state.cache.move_to_end(grammar)
            state.hits += 1
            return found
    matcher = llguidance.LLMatcher(state.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.lark()),
                                   log_level=0, limits=_LIMITS)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    compiled = Compiled(matcher, state.n_vocab)
    with _LOCK:
        state.misses += 1
        state.cache[grammar] = compiled
        while len(state.cache) > CACHE_ENTRIES:
            state.cache.popitem(last=False)
    return compiled


def first_error(runtime: ModelRuntime, schemas: Sequence[str]) -> tuple[int, str] | None:
    """The first of ``schemas`` (JSON Schemas as JSON text) the library cannot build, and why (None: it
    builds them all): which part of a grammar that failed is to blame."""
    state = _state(runtime)
    for i, schema in enumerate(schemas):
        text = llguidance.LLMatcher.grammar_from_lark(Grammar(content=schema).lark())
        error = llguidance.LLMatcher.validate_grammar(text, state.tokenizer, limits=_LIMITS)
        if error and not error.startswith("WARNING"):
            return i, error
    return None


def cache_stats(runtime: ModelRuntime) -> dict[str, int]:
    """The compiled-grammar cache of the runtime's tokenizer: hits, misses (compilations), entries."""
    state = _state(runtime)
    with _LOCK:
        return {"hits": state.hits, "misses": state.misses, "entries": len(state.cache)}
