"""Bounds of the serving face without a model: the OFFER's conversation prefix (a peer's field) and the
OpenAI request models (a client's), each refused with the field named."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pfec.common.node.openai_models import ChatCompletionRequest, CompletionRequest
from pfec.common.plan.handoff import OfferApp, PrefixOffer


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


def _chat(**fields: object) -> str:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(("fields", "where"), [
    ({"n": 3}, "n"), ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 4, "max_completion_tokens": 4}, "max_completion"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logprobs": True}, "logprobs"), ({"tools": []}, "tools"), ({"max_tokens": True}, "max_tokens"),
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
