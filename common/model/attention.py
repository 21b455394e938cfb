"""Attention with per-(layer, KV head, token) row masks, and per-request attention observation.

Partial KV (paper V-B), ``mask`` mode: an unavailable (layer, KV head, token) row is excluded from
attention by ``pfec_sdpa``, an attention function registered with transformers' ``AttentionInterface``
under ``PFEC_ATTENTION``. It repeats a KV head's row mask over that head's query group, keeps new rows
causal and valid, and otherwise is plain SDPA (no T x T matrix is ever materialised in Python).

Which masks apply is set per call through context variables (``row_masks``, ``observing``), so one loaded
model serves every request without being reconfigured.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PFEC_ATTENTION = "pfec_sdpa"

# Row masks of the cache being decoded: one bool [n_kv_heads, n_context] tensor per layer (None: all rows).
_ROW_MASKS: contextvars.ContextVar[Sequence[torch.Tensor | None] | None] = contextvars.ContextVar(
    "pfec_row_masks", default=None
)
# Per-request utility: window size and the per-layer attention mass [n_kv_heads, T] it collects.
_OBSERVATION: contextvars.ContextVar[Observation | None] = contextvars.ContextVar(
    "pfec_observation", default=None
)


@dataclass
class Observation:
    """Attention mass each KV row receives from the last ``window`` queries of a prefill (SnapKV/H2O)."""

    window: int
    mass: dict[int, torch.Tensor] = field(default_factory=dict)

    def as_array(self) -> npt.NDArray[np.float64]:
        """[layers, KV heads, tokens]: what ``utility.request_block_utilities`` takes."""
        return np.stack([self.mass[i].double().numpy() for i in sorted(self.mass)])


def _observe(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, obs: Observation,
             scaling: float | None) -> None:
    """Softmax of the last ``window`` queries only: [Hq, W, T], never T x T."""
    n_kv, kv_len = key.shape[1], key.shape[2]
    window = min(obs.window, query.shape[2])
    q = query[0, :, -window:, :].float()
    k = repeat_kv(key, query.shape[1] // n_kv)[0].float()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    q_pos = torch.arange(kv_len - window, kv_len, device=q.device)[:, None]
    future = torch.arange(kv_len, device=q.device)[None, :] > q_pos
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    per_query_head = weights.sum(dim=1)  # [Hq, T]
    obs.mass[int(module.layer_idx)] = per_query_head.view(n_kv, -1, kv_len).sum(dim=1).cpu()


def _allowed_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int,
                  device: torch.device) -> torch.Tensor:
    """Bool [q, kv]: causal (queries are the last q_len positions), AND the model's own mask if any."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    allowed = torch.arange(kv_len, device=device)[None, :] <= q_pos
    if attention_mask is not None:
        own = attention_mask[0, 0, -q_len:, -kv_len:]
        allowed = allowed & (own if own.dtype == torch.bool else own == 0)
    return allowed


def pfec_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA that also drops unavailable (KV head, token) rows of this layer.

    The layer's row mask is [KV heads, context] (one cache) or [batch, KV heads, context] (a batch of
    caches of one context, each with its own rows: ``generate_batch``)."""
    obs = _OBSERVATION.get()
    if obs is not None:
        _observe(module, query, key, obs, scaling)
    masks = _ROW_MASKS.get()
    rows = None if masks is None else masks[int(module.layer_idx)]
    if rows is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        return out, None
    n_q_heads, q_len = query.shape[1], query.shape[2]
    n_kv, kv_len = key.shape[1], key.shape[2]
    groups = n_q_heads // n_kv
    batched = rows if rows.dim() == 3 else rows[None]
    row_ok = torch.ones(batched.shape[0], n_kv, kv_len, dtype=torch.bool, device=query.device)
    row_ok[:, :, : batched.shape[2]] = batched  # rows generated after the handoff are always valid
    allowed = _allowed_mask(attention_mask, q_len, kv_len, query.device)
    # A KV head's query group attends as one [groups * q_len] block of queries, so K and V are never
    # repeated per query head (that copy, not the arithmetic, dominated decoding a batch of caches).
    batch, head_dim = query.shape[0], query.shape[3]
    grouped = query.reshape(batch, n_kv, groups * q_len, head_dim)
    mask = allowed.repeat(groups, 1)[None, None] & row_ok[:, :, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, n_q_heads, q_len, head_dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(PFEC_ATTENTION, pfec_sdpa)
AttentionMaskInterface.register(PFEC_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def row_masks(masks: Sequence[torch.Tensor | None] | None) -> Iterator[None]:
    """Apply per-layer row masks to every ``pfec_sdpa`` call inside the block."""
    token = _ROW_MASKS.set(masks)
    try:
        yield
    finally:
        _ROW_MASKS.reset(token)


@contextlib.contextmanager
def observing(window: int) -> Iterator[Observation]:
    """Collect the attention mass of the last ``window`` queries of every ``pfec_sdpa`` call inside."""
    obs = Observation(window=window)
    token = _OBSERVATION.set(obs)
    try:
        yield obs
    finally:
        _OBSERVATION.reset(token)
