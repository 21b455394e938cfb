"""What an OFFER must satisfy on this receiver node before the daemon plans anything for it.

Pure checks, no I/O: the daemon (:mod:`pfec.receiver.daemon`) calls them and turns a refusal into a
REFUSE with the reason.

- ``admit``: the endpoint's admission, before its session allocates a decoder: the budget and the KV size
  against this node's limits.
- ``check_offer_app``: the OFFER's application blob (``OfferApp.decode``, bounded by the node's maximum
  context and blob size), its plan against the OFFER's symbols, a split's token ids against the model.
- ``check_stream``: a quantised OFFER, once its profile is known: its piece plan recomputed here (scheme,
  fidelity table, digest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pfec.common.node.config import LimitsConfig
from pfec.common.plan.handoff import (
    BLOCK_TOKENS,
    LOCAL_SOURCE_SYMBOLS,
    ModelIdentity,
    OfferApp,
)
from pfec.common.plan.kvlayout import FRAGMENT_ID_SIZE, BlockPlan
from pfec.common.plan.pieces import Level
from pfec.common.plan.precision import PieceLayout
from pfec.common.plan.stream import check_offer, fidelity_named
from pfec.common.plan.utility import UtilityProfile
from pfec.common.wire.messages import Offer, RefuseCode
from pfec.receiver.rebuild import StreamPlan

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime


def admit(offer: Offer, limits: LimitsConfig, max_plan: BlockPlan, max_tokens: int
          ) -> tuple[RefuseCode, str] | None:
    """The endpoint's admission check, before the session allocates anything: the budget and the KV
    size against this node's limits (the blob's own fields are checked in ``check_offer_app``)."""
    max_us = limits.max_budget_ms * 1000
    if offer.budget_us > max_us:
        return (RefuseCode.BAD_PARAMETERS, f"OFFER budget {offer.budget_us / 1000:.0f} ms is above this "
                f"receiver's limits.max_budget_ms ({limits.max_budget_ms:g})")
    if offer.n_source > max_plan.n_fragments or offer.symbol_size != max_plan.symbol_size:
        return (RefuseCode.BAD_PARAMETERS, f"OFFER of {offer.n_source} symbols of {offer.symbol_size} B "
                f"exceeds this receiver's maximum context of {max_tokens} tokens "
                f"({max_plan.n_fragments} symbols of {max_plan.symbol_size} B)")
    return None


def check_offer_app(app_blob: bytes, offer: Offer, identity: ModelIdentity, runtime: ModelRuntime | None,
                    max_tokens: int, max_blob_bytes: int) -> OfferApp:
    """The OFFER's application part, decoded and checked against this node (ValueError with the reason)."""
    app = OfferApp.decode(app_blob, max_tokens=max_tokens, max_blob_bytes=max_blob_bytes)
    plan = identity.plan(app.n_tokens)  # bounded: n_tokens <= max_tokens
    n_source = plan.n_fragments if app.precision is None else offer.n_source  # checked later
    if app.held is not None:  # a chain: blocks lost upstream are not streamed (native), never data
        if app.held.n_layers != plan.geometry.n_layers:
            raise ValueError(f"OFFER held layers: {app.held.n_layers}, this model has "
                             f"{plan.geometry.n_layers}")
        if app.precision is None:
            sent = app.held.block_levels(plan) != Level.NONE
            n_source = sum(len(plan.block_fragments(int(b))) for b in np.flatnonzero(sent))
    if app.split is not None:
        check_split(app, runtime)
        if is_local(app):  # a local prefill: one placeholder symbol, no KV
            n_source = LOCAL_SOURCE_SYMBOLS
        # a native split streams every fragment (the back, then the front): the whole cache's count
    if n_source != offer.n_source or plan.symbol_size != offer.symbol_size:
        raise ValueError(
            f"OFFER plan: {app.n_tokens} tokens give {plan.n_fragments} symbols of "
            f"{plan.symbol_size} B here, the sender offers {offer.n_source} of "
            f"{offer.symbol_size} B"
        )
    if app.generate and runtime is None:
        raise ValueError("OFFER asks for generation, but this receiver runs without a model")
    return app


def is_local(app: OfferApp) -> bool:
    """A local prefill: a split whose meeting point is the context's end (nothing streams)."""
    return app.split is not None and app.split.meeting_token >= app.n_tokens


def check_split(app: OfferApp, runtime: ModelRuntime | None) -> None:
    """A split's token ids against this node's model (ValueError with the reason)."""
    split = app.split
    assert split is not None
    if is_local(app) and app.precision is not None:
        raise ValueError("OFFER split: a local prefill (m = the context's length) streams no precision plan")
    if runtime is None:
        raise ValueError("OFFER split: this receiver runs without a model (it cannot prefill the front)")
    vocab = int(getattr(runtime.model.config, "vocab_size", 0) or 0)
    if vocab and max(split.context_ids, default=0) >= vocab:
        raise ValueError(f"OFFER split ids: a token id past this model's vocabulary of {vocab}")


def check_stream(identity: ModelIdentity, app: OfferApp, profile: UtilityProfile, symbol_size: int,
                 n_source: int) -> StreamPlan:
    """A quantised OFFER's piece plan, recomputed here; ValueError with the reason when the scheme is not
    this node's, the fidelity table is unknown here or the plan differs."""
    offer = app.precision
    assert offer is not None
    g = identity.geometry
    fidelity = fidelity_named(offer.fidelity, g.n_layers, identity.details.get("model_digest"))
    layout = PieceLayout(g, app.n_tokens, BLOCK_TOKENS)
    utilities = profile.block_utilities(identity.plan(app.n_tokens))
    first_block = 0 if app.split is None else app.split.meeting_token // BLOCK_TOKENS
    # a chain: the blocks its sender lost upstream carry no pieces (the OFFER's held map says which)
    absent = None if app.held is None else app.held.block_levels(identity.plan(app.n_tokens)) == Level.NONE
    plan = check_offer(offer, layout, utilities, fidelity, symbol_size - FRAGMENT_ID_SIZE,
                       n_source, app.order, identity.quant_scheme, first_block, front_after=first_block > 0,
                       absent=absent)
    return StreamPlan(offer.mix, plan, fidelity)
