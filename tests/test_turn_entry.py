"""One stream surface and one turn entry: every kind of reply stream (plain, tool loop, guided, async)
offers the same members and ``result()`` is what ``respond`` returns; every turn method takes the same
options (``TurnOptions``), checked before anything changes."""

import asyncio
import inspect
import json

from chatkit import AsyncResponseStream, ChatSession, GenerateParams, InvalidParamsError, ResponseStream, ToolLoopStream
from chatkit.session.options import TurnKeywords, TurnOptions
from chatkit.session.streams import GuidedStream, ReplyStream
from chatkit.testing import Scripted

import pytest
from pydantic import BaseModel, ConfigDict, Field

SURFACE = ("text", "reasoning", "tool_calls", "tokens", "finish_reason", "stats", "closed", "rounds", "tool_results")


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=6)


def weather(city: str) -> str:
    """The weather of a city.

    Args:
        city: The city's name.
    """
    return f"sunny in {city}"


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def sessions(tiny):
    """A plain session, one with tools (scripted to call one and answer), one for guided replies."""
    lm = tiny(tokenizer="bpe-think")
    plain = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=8)).build()
    script = Scripted(lm.tokenizer, ["<think>\nLook it up.\n</think>\n\n" + call("weather", city="Oslo"), "Sunny."])
    tools = (ChatSession.builder(lm).tools([weather])
             .generate_params(GenerateParams(max_tokens=60, logits_processors=[script])).build())
    guided = ChatSession.builder(tiny(tokenizer="bpe")).generate_params(GenerateParams(max_tokens=120)).build()
    return plain, tools, guided


def check_surface(stream, result):
    for name in SURFACE:
        getattr(stream, name)  # every stream has every member
    assert stream.closed and stream.stats is not None and stream.finish_reason is not None
    assert stream.result() == result


def test_every_sync_stream_has_the_surface_and_result_is_what_respond_returns(tiny):
    plain, tools, guided = sessions(tiny)
    with plain.stream_respond("Hi") as stream:
        list(stream)
    assert isinstance(stream, ResponseStream) and isinstance(stream, ReplyStream)
    check_surface(stream, stream.text)
    assert (stream.rounds, stream.tool_results) == (1, [])
    assert plain.regenerate() == plain.history[-1].content

    with tools.stream_respond("Weather in Oslo?") as stream:
        list(stream)
    assert isinstance(stream, ToolLoopStream) and isinstance(stream, ReplyStream)
    check_surface(stream, "Sunny.")
    assert stream.rounds == 2 and [m.content for m in stream.tool_results] == ["sunny in Oslo"]

    with guided.stream_respond("My pet is Rex.", output=Pet) as stream:
        list(stream)
    assert isinstance(stream, GuidedStream) and isinstance(stream, ReplyStream)
    check_surface(stream, stream.value)
    assert isinstance(stream.result(), Pet) and stream.reasoning == "" and stream.tool_calls == []
    assert guided.regenerate() == Pet.model_validate_json(guided.history[-1].content)


def test_every_async_stream_has_the_surface_and_result_is_what_arespond_returns(tiny):
    plain, _, guided = sessions(tiny)

    async def run():
        async with plain.astream_respond("Hi") as stream:
            async for _ in stream:
                pass
        check_surface(stream, stream.text)
        async with guided.astream_respond("My pet is Rex.", output=Pet) as guided_stream:
            async for _ in guided_stream:
                pass
        check_surface(guided_stream, guided_stream.value)
        return stream, guided_stream, await guided.arespond("My pet is Tom.", output=Pet)

    stream, guided_stream, value = asyncio.run(run())
    assert isinstance(stream, AsyncResponseStream) and isinstance(guided_stream.result(), Pet)
    assert isinstance(value, Pet) and value == Pet.model_validate_json(guided.history[-1].content)


def test_the_turn_methods_take_the_same_options():
    for name in ("respond", "stream_respond", "arespond", "astream_respond"):
        parameters = inspect.signature(getattr(ChatSession, name)).parameters
        assert list(parameters) == ["self", "prompt", "options"], name
    assert set(TurnKeywords.__annotations__) == {f for f in TurnOptions.__dataclass_fields__}


def test_an_unknown_or_bad_option_is_refused_before_anything_changes(tiny):
    plain, _, _ = sessions(tiny)
    plain.respond("Hi")
    before = plain.history
    for bad in ({"rol": "user"}, {"strict_tools": "yes"}):
        with pytest.raises(InvalidParamsError):
            plain.respond("Hello again", **bad)
        with pytest.raises(InvalidParamsError):
            asyncio.run(plain.arespond("Hello again", **bad))
    assert plain.history == before and not plain.busy
