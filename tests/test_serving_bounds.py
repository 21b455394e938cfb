"""Bounds of the serving face without a model: the OFFER's prefix (a peer's field; its size against what a
receiver takes) and the OpenAI request models (a client's), each refused with the field named."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pfec.common.node.config import LimitsConfig
from pfec.common.node.openai.models import ChatCompletionRequest, CompletionRequest
from pfec.common.plan.handoff import MAX_QUESTION_TOKENS, OfferApp, PrefixOffer, SplitOffer
from pfec.common.wire.messages import MsgType, split_app
from pfec.sender.control import HandoffRequest
from pfec.sender.daemon import MAX_OFFER_PARTS, offer_blob


def test_an_offers_conversation_prefix_round_trips_and_is_bounded() -> None:
    app = OfferApp(3, (), prefix=PrefixOffer("team-a", (5, 6, 7)), generate=False)
    again = OfferApp.decode(app.encode())
    assert again.prefix == PrefixOffer("team-a", (5, 6, 7)) and not again.generate
    assert OfferApp.decode(OfferApp(3, (1,)).encode()).prefix is None  # a question/answer blob as before
    data = json.loads(app.encode())
    for bad, why in (({"salt": "x" * 257, "ids": [1, 2, 3]}, "salt"), ({"salt": "", "ids": [1, 2]}, "ids"),
                     ({"salt": "", "ids": [1, 2, -1]}, "ids"), ({"salt": "", "ids": [1, 2, True]}, "ids"),
                     ({"salt": 1, "ids": [1, 2, 3]}, "salt"), ([1], "prefix"),
                     ({"salt": "", "ids": [1, 2, 3], "more": 1}, "prefix")):
        with pytest.raises(ValueError, match=why):
            OfferApp.decode(json.dumps({**data, "prefix": bad}).encode())


def test_a_splits_offer_carries_the_context_ids_once() -> None:
    ids = (5, 6, 7, 8) * 8
    split = SplitOffer(16, ids)
    app = OfferApp(32, (1,), split=split, prefix=PrefixOffer("", ids))
    assert json.loads(app.encode())["prefix"] == {"salt": ""}
    again = OfferApp.decode(app.encode())
    assert again.prefix == PrefixOffer("", ids) and again.split == split
    data = json.loads(OfferApp(32, (1,), prefix=PrefixOffer("", ids)).encode())
    with pytest.raises(ValueError, match="no split carries them"):
        OfferApp.decode(json.dumps({**data, "prefix": {"salt": ""}}).encode())


# The default model's largest token id (a 49,152-token vocabulary): five digits, the widest ids it sends.
_WIDEST_ID = 49_151


def _parts(app: OfferApp) -> int:
    return len(split_app(app.encode(), MsgType.OFFER))


def test_a_question_answer_offer_with_its_prefix_fits_at_the_configured_maximum_context() -> None:
    """A question/answer handoff now carries the context's ids (its prefix): at the default
    limits.max_context_tokens, with the widest ids of the default model and the longest question the
    context leaves room for, whole or split, its OFFER stays within what a receiver takes."""
    n = LimitsConfig().max_context_tokens
    ids = (_WIDEST_ID,) * n
    question = (_WIDEST_ID,) * MAX_QUESTION_TOKENS
    whole = OfferApp(n, question, prefix=PrefixOffer("s" * 256, ids))
    split = OfferApp(n, question, split=SplitOffer(n // 2, ids), prefix=PrefixOffer("s" * 256, ids))
    assert _parts(whole) <= MAX_OFFER_PARTS and _parts(split) <= MAX_OFFER_PARTS


def test_an_offer_too_long_drops_a_question_answer_prefix_and_refuses_a_conversation() -> None:
    n = 16_384  # a node configured past the default bound
    ids = (_WIDEST_ID,) * n
    app = OfferApp(n, (1, 2), prefix=PrefixOffer("", ids))
    assert _parts(app) > MAX_OFFER_PARTS
    sent, blob = offer_blob(app, prefix_optional=True)
    assert sent.prefix is None and OfferApp.decode(blob, max_tokens=n).prefix is None
    with pytest.raises(ValueError, match="datagrams, above"):
        offer_blob(app, prefix_optional=False)
    fits = OfferApp(16, (1,), prefix=PrefixOffer("", (3,) * 16))
    assert offer_blob(fits, prefix_optional=True) == (fits, fits.encode())


def _chat(**fields: object) -> str:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(("fields", "where"), [
    ({"n": 3}, "n"), ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 4, "max_completion_tokens": 4}, "max_completion"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logprobs": True}, "logprobs"), ({"max_tokens": True}, "max_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                     "messages"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_chat_requests_out_of_bounds_name_the_field(fields: dict[str, object], where: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(_chat(**fields), strict=True)
    assert any(where in ".".join(map(str, e["loc"])) or where in e["msg"] for e in caught.value.errors())


def test_well_formed_requests_parse() -> None:
    chat = ChatCompletionRequest.model_validate_json(_chat(
        stop="x", temperature=0, seed=3, cache_salt="s", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]}]),
        strict=True)
    assert chat.stops == ("x",) and chat.salt == "s" and chat.include_usage
    assert chat.rendered() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    done = CompletionRequest.model_validate_json('{"model": "m", "prompt": "p"}', strict=True)
    assert done.limit == 16 and done.salt == ""
    with pytest.raises(ValidationError, match="echo"):
        CompletionRequest.model_validate_json('{"model": "m", "prompt": "p", "echo": true}', strict=True)


def test_a_handoff_requests_cache_salt_is_bounded_and_reaches_its_context() -> None:
    base = {"receiver": "127.0.0.1:9", "context": "c", "question": "q"}
    spec = HandoffRequest.model_validate_json(json.dumps({**base, "cache_salt": "team"}), strict=True).spec()
    assert spec.inputs.cache_salt == "team" and spec.inputs.prefix((1, 2)) == PrefixOffer("team", (1, 2))
    assert HandoffRequest.model_validate_json(json.dumps(base), strict=True).spec().inputs.cache_salt == ""
    for bad in ({"cache_salt": ""}, {"cache_salt": "x" * 257}, {"cache_salt": 3},
                {"cache_salt": "t", "context": None, "question": None, "synthetic_tokens": 64},
                {"cache_salt": "t", "context": None, "question": None, "conversation": {"id": "chatcmpl-1"}}):
        body = {k: v for k, v in {**base, **bad}.items() if v is not None}
        with pytest.raises(ValidationError, match="cache_salt"):
            HandoffRequest.model_validate_json(json.dumps(body), strict=True)
