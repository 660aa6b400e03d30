"""Tools: schemas from functions, the automatic loop (parallel calls, results in order, errors fed
back, async tools, the round limit), manual mode, and exact cache reuse across tool rounds. The model's
output is forced with a script (random weights cannot write a tool call)."""

import asyncio
import json
import threading

from chatkit import (
    ChatMessage,
    ChatSession,
    GenerateParams,
    InvalidMessageError,
    InvalidParamsError,
    Role,
    SessionBusyError,
    ToolExecutionError,
    ToolLoopLimitError,
)
from chatkit.testing import Scripted
from chatkit.tools import as_tool

import pytest
from conftest import assert_ledger_matches_cache, cache_state, fresh_reply


def get_weather(city: str, unit: str = "celsius") -> dict:
    """The current weather of a city.

    Args:
        city: The city's name.
        unit: "celsius" or "fahrenheit".
    """
    return {"city": city, "sky": "sunny" if city == "Paris" else "rain", "unit": unit}


async def local_time(city: str) -> str:
    """The local time of a city.

    Args:
        city: The city's name.
    """
    await asyncio.sleep(0)
    return f"12:00 in {city}"


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"broken: {reason}")


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def scripted(lm, replies, tools=(get_weather, local_time, explode), max_tokens=80, **tool_options):
    script = Scripted(lm.tokenizer, replies)
    params = GenerateParams(max_tokens=max_tokens, logits_processors=[script])
    return ChatSession.builder(lm).tools(list(tools), **tool_options).generate_params(params).build(), script


@pytest.fixture
def lm(tiny):
    return tiny(tokenizer="bpe-think")


def test_a_functions_schema_comes_from_its_signature_and_docstring():
    schema = as_tool(get_weather).schema["function"]
    assert schema["name"] == "get_weather" and schema["description"] == "The current weather of a city."
    assert schema["parameters"]["required"] == ["city"]
    assert schema["parameters"]["properties"]["city"] == {"type": "string", "description": "The city's name."}
    assert as_tool({"name": "f", "parameters": {"type": "object"}}).schema == {
        "type": "function", "function": {"name": "f", "parameters": {"type": "object"}}
    }


def test_tools_that_cannot_be_described_are_refused_with_what_to_do(lm):
    def undocumented(x: int):
        return x

    with pytest.raises(InvalidParamsError, match="docstring"):
        ChatSession.builder(lm).tools([undocumented])
    with pytest.raises(InvalidParamsError, match="unique"):
        ChatSession.builder(lm).tools([get_weather, get_weather])
    with pytest.raises(InvalidParamsError, match="needs a name"):
        ChatSession.builder(lm).tools([{"type": "function", "function": {}}])
    with pytest.raises(InvalidParamsError, match="manual"):
        ChatSession.builder(lm).tools([get_weather], tool_execution="later")


def test_the_loop_runs_parallel_calls_in_order_and_the_model_answers(lm):
    both = call("get_weather", city="Paris") + "\n" + call("local_time", city="Rome")
    session, _ = scripted(lm, [f"<think>\nTwo things.\n</think>\n\n{both}", "Sunny, and noon."])
    with session.stream_respond("Weather in Paris, time in Rome?") as stream:
        chunks = list(stream)
    assert stream.text == "Sunny, and noon." and stream.rounds == 2
    user, asked, weather, time, answer = session.history
    assert [c.name for c in asked.tool_calls] == ["get_weather", "local_time"] and asked.reasoning == "Two things."
    assert (weather.role, weather.name, weather.tool_call_id) == (Role.TOOL, "get_weather", asked.tool_calls[0].id)
    assert json.loads(weather.content) == get_weather("Paris")
    assert (time.name, time.tool_call_id, time.content) == ("local_time", asked.tool_calls[1].id, "12:00 in Rome")
    assert answer == ChatMessage.assistant("Sunny, and noon.")
    # Chunks: round 1 ends with "tool_calls", then one tool_result per call (in order), then round 2.
    kinds = [c.kind for c in chunks]
    first_result = kinds.index("tool_result")
    assert chunks[first_result - 1].finish_reason == "tool_calls"
    assert [c.tool_call for c in chunks if c.kind == "tool_result"] == list(asked.tool_calls)
    assert [c.text for c in chunks if c.kind == "tool_result"] == [weather.content, time.content]
    assert chunks[-1].finish_reason == "stop" and "tool_result" not in kinds[first_result + 2 :]
    # The schemas reached the template through its tools variable.
    assert '"name": "get_weather"' in session.render() and '"name": "local_time"' in session.render()
    assert_ledger_matches_cache(session)


def test_a_tool_round_prefills_only_the_tool_result_and_the_templates_glue(lm):
    session, _ = scripted(lm, [f"<think>\nLook it up.\n</think>\n\n{call('get_weather', city='Paris')}", "Sunny."],
                          tool_execution="manual")
    session.respond("Weather?")
    held = cache_state(session).ledger.tokens  # the prompt and the reply with its call, as generated
    (pending,) = session.pending_tool_calls
    session.respond("sunny", role=Role.TOOL, tool_call_id=pending.id)
    stats = session.last_stats
    assert stats.reused_tokens == len(held)  # nothing trimmed: the reply renders back as it was written
    assert stats.plan == "append"
    assert 0 < stats.prefilled_tokens <= 40  # "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n..." only
    assert session.history[-2] == ChatMessage.tool("sunny", name="get_weather", tool_call_id=pending.id)


def test_the_next_turn_equals_a_fresh_session_replaying_a_history_with_tool_rounds(lm):
    session, _ = scripted(lm, [f"<think>\nHmm.\n</think>\n\n{call('get_weather', city='Rome')}", "Rain in Rome."])
    assert session.respond("Weather in Rome?") == "Rain in Rome."
    session.generate_params = GenerateParams(max_tokens=10)  # the script is spent: free greedy decoding
    expected = fresh_reply(session, "And tomorrow?", tools=[get_weather, local_time, explode])
    with session.stream_respond("And tomorrow?") as stream:
        for _ in stream:
            pass
    assert stream.tokens == expected
    assert_ledger_matches_cache(session)


@pytest.mark.parametrize(
    "bad_call, error",
    [
        (call("get_forecast", city="Paris"), "There is no tool named 'get_forecast'"),
        (call("get_weather", city=7), "Invalid arguments for get_weather: city: 7 is not of type 'string'"),
        (call("get_weather"), "Invalid arguments for get_weather: 'city' is a required property"),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', "The tool call is not valid"),
        (call("explode", reason="test"), "explode raised RuntimeError: broken: test"),
    ],
)
def test_a_failing_call_is_told_to_the_model_and_nothing_is_lost(lm, bad_call, error):
    session, _ = scripted(lm, [bad_call, "Sorry."])
    assert session.respond("Go.") == "Sorry."
    user, asked, result, answer = session.history
    assert len(asked.tool_calls) == 1 and result.tool_call_id == asked.tool_calls[0].id
    assert result.content.startswith("Error: " + error), result.content


def test_errors_raise_when_the_app_asks_and_the_call_stays_in_the_history(lm):
    session, _ = scripted(lm, [call("explode", reason="x"), "Never."], errors="raise")
    with pytest.raises(ToolExecutionError, match="broken: x") as info:
        session.respond("Go.")
    assert info.value.call.name == "explode"
    assert session.history[-1].tool_calls == (info.value.call,) and not session.busy


def test_async_tools_run_also_under_a_running_event_loop(lm):
    session, _ = scripted(lm, [call("local_time", city="Oslo"), "Noon."])

    async def main():
        return await session.arespond("Time in Oslo?")

    assert asyncio.run(main()) == "Noon."
    assert session.history[2].content == "12:00 in Oslo"


def test_the_round_limit_raises_and_the_session_stays_usable(lm):
    again = call("get_weather", city="Paris")
    session, _ = scripted(lm, [again, again, again, "Done."], max_tool_rounds=2)
    with pytest.raises(ToolLoopLimitError, match="after 2 rounds"):
        session.respond("Loop.")
    roles = [m.role for m in session.history]
    assert roles == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert session.pending_tool_calls == list(session.history[-1].tool_calls) and not session.busy
    assert session.respond("Stop calling tools.") == "Done."


def test_manual_mode_returns_the_calls_and_waits_for_every_result(lm):
    both = call("get_weather", city="Paris") + "\n" + call("get_weather", city="Rome")
    session, _ = scripted(lm, [both, "Paris sunny, Rome rain."], tool_execution="manual")
    with session.stream_respond("Both cities?") as stream:
        for _ in stream:
            pass
    assert stream.finish_reason == "tool_calls" and len(stream.tool_calls) == 2
    first, second = session.pending_tool_calls
    with pytest.raises(InvalidMessageError, match="tool_call_id"):
        session.respond("sunny", role=Role.TOOL)  # two calls wait: which one?
    assert session.respond("sunny", role=Role.TOOL, tool_call_id=first.id) == ""  # another call still waits
    assert session.pending_tool_calls == [second] and session.history[-1].role is Role.TOOL
    assert session.respond("rain", role=Role.TOOL, tool_call_id=second.id) == "Paris sunny, Rome rain."
    assert [m.tool_call_id for m in session.history[2:4]] == [first.id, second.id]
    assert [m.name for m in session.history[2:4]] == ["get_weather", "get_weather"]


def test_undo_drops_the_whole_exchange_of_a_tool_loop_and_one_prompt_in_manual_mode(lm):
    both = call("get_weather", city="Paris") + "\n" + call("local_time", city="Rome")
    session, _ = scripted(lm, ["Hi.", both, "Sunny, and noon."])
    session.respond("Hello")
    session.respond("Weather in Paris, time in Rome?")
    dropped = session.undo()  # the question, the calls, both results and the answer: one exchange
    assert [m.role for m in dropped] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL, Role.ASSISTANT]
    assert [m.content for m in session.history] == ["Hello", "Hi."]
    assert_ledger_matches_cache(session)

    manual, _ = scripted(lm, [call("get_weather", city="Paris"), "Sunny."], tool_execution="manual")
    manual.respond("Weather in Paris?")
    (pending,) = manual.pending_tool_calls
    manual.respond("sunny", role=Role.TOOL, tool_call_id=pending.id)
    dropped = manual.undo()  # the app sent the result as a prompt: undo drops that prompt and its reply
    assert [m.role for m in dropped] == [Role.TOOL, Role.ASSISTANT] and manual.pending_tool_calls == [pending]


def test_a_tool_loop_holds_the_session_between_its_rounds_while_its_tool_runs(lm, tmp_path):
    """A slow tool (or an app holding the stream after a tool result) must not let another turn or an
    edit in between the rounds: the results would land after an unrelated exchange."""
    entered, go_on = threading.Event(), threading.Event()

    def slow(city: str) -> str:
        """A slow lookup.

        Args:
            city: The city.
        """
        entered.set()
        assert go_on.wait(30)
        return "sunny"

    session, _ = scripted(lm, [call("slow", city="Paris"), "Sunny.", call("slow", city="Rome"), "Rainy."], tools=[slow])
    go_on.set()  # first the app holds the stream after a tool result; then (asyncio) the tool is slow
    stream = session.stream_respond("Weather in Paris?")
    assert session.busy  # from the start, as a plain turn
    for chunk in stream:
        if chunk.kind == "tool_result":
            break  # between the rounds, the stream open
    edits = [lambda: session.respond("Hello"), session.clear, session.undo, session.fork, session.regenerate,
             lambda: session.save_cache(tmp_path / "c.safetensors"), lambda: setattr(session, "instructions", "x")]
    for edit in edits:
        with pytest.raises(SessionBusyError):
            edit()
    assert session.busy and [m.role for m in session.history] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert [c.text for c in stream][-1] == "" and stream.text == "Sunny." and not session.busy
    assert [m.content for m in session.history] == ["Weather in Paris?", "", "sunny", "Sunny."]

    async def two_turns():  # the same from asyncio: the second turn waits for nothing and is refused
        entered.clear()
        go_on.clear()
        session.clear()
        first = asyncio.create_task(session.arespond("Weather in Rome?"))
        await asyncio.to_thread(entered.wait, 30)
        assert session.busy
        with pytest.raises(SessionBusyError):
            await session.arespond("Hello")
        go_on.set()
        return await first

    assert asyncio.run(two_turns()) == "Rainy."
    assert [m.content for m in session.history] == ["Weather in Rome?", "", "sunny", "Rainy."]
    assert_ledger_matches_cache(session)


def test_a_tool_loop_stopped_after_its_tool_ran_can_be_undone_or_answered(lm):
    session, _ = scripted(lm, ["Hi.", call("get_weather", city="Paris"), "Sunny."])
    session.respond("Hello")
    with session.stream_respond("Weather in Paris?") as stream:
        for chunk in stream:
            if chunk.kind == "tool_result":
                break  # Stop pressed once the tool ran: the call and its result stay
    assert [m.role for m in session.history][-3:] == [Role.USER, Role.ASSISTANT, Role.TOOL] and not session.busy
    assert session.regenerate() == "Sunny."  # answers the results
    assert [m.role for m in session.history][-4:] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert_ledger_matches_cache(session)

    session, _ = scripted(lm, ["Hi.", call("get_weather", city="Paris"), "Sunny."])
    session.respond("Hello")
    with session.stream_respond("Weather in Paris?") as stream:
        for chunk in stream:
            if chunk.kind == "tool_result":
                break
    dropped = session.undo()  # the prompt, the call and its result: the way out of a stuck loop
    assert [m.role for m in dropped] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert [m.content for m in session.history] == ["Hello", "Hi."]
    assert_ledger_matches_cache(session)


def test_an_async_stream_tells_what_a_tool_loop_stream_tells(lm):
    session, _ = scripted(lm, [f"<think>\nLook it up.\n</think>\n\n{call('get_weather', city='Paris')}", "Sunny."])

    async def run():
        async with session.astream_respond("Weather in Paris?") as stream:
            async for _ in stream:
                pass
        return stream

    stream = asyncio.run(run())
    sync = session.history
    assert stream.text == "Sunny." and stream.finish_reason == "stop" and stream.rounds == 2
    assert [c.name for c in stream.tool_calls] == ["get_weather"] and stream.tool_results == [sync[2]]
    assert stream.reasoning == "" and sync[1].reasoning == "Look it up."  # the last round's, as synchronously


def test_a_stream_closed_inside_a_tool_call_keeps_the_call_as_far_as_written(lm):
    session, _ = scripted(lm, [call("get_weather", city="Paris")])
    with session.stream_respond("Weather in Paris?") as stream:
        shown = ""
        for chunk in stream:
            shown += chunk.text
            if '"arguments"' in shown:
                break  # Stop pressed in the middle of the call
    (cut,) = session.history[-1].tool_calls  # as a max_tokens cut keeps it: unread, with its text
    assert cut.error is not None and cut.text == shown and cut.arguments == {}
    assert not session.busy and stream.tool_results == []  # an unread call is not run
    assert_ledger_matches_cache(session)


TYPED_USE = '''
from chatkit import ChatSession, StreamChunk, ToolCall, ToolLoopStream


def use(session: ChatSession) -> None:
    stream = session.stream_respond("Weather in Paris?")
    with stream:
        chunks: list[StreamChunk] = list(stream)
    answer: str = stream.text
    reasoning: str = stream.reasoning
    calls: list[ToolCall] = stream.tool_calls
    if isinstance(stream, ToolLoopStream):
        rounds: int = stream.rounds
'''


@pytest.mark.slow
def test_the_stream_types_stream_respond_returns_are_what_mypy_sees(tmp_path):
    """With tools ``stream_respond`` returns a ``ToolLoopStream``: its return type says so, the name is
    public, and what both kinds of stream offer type-checks without casts."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "use.py").write_text(TYPED_USE)
    root = Path(__file__).resolve().parent.parent
    # Incremental, with test_code_quality's options: chatkit's modules come from the cache test_mypy left
    # (about 2 s instead of a 40 s cold check; run alone, this checks them first).
    out = subprocess.run([sys.executable, "-m", "mypy", str(tmp_path / "use.py")],
                         cwd=root, env={**os.environ, "MYPYPATH": str(root)}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_cannot_render_calls_gets_them_in_the_models_own_format(lm):
    # The template shows role and content only: past calls go into the reply's content as the model writes
    # them (the format its parser reads), not as {"tool_calls": ...} JSON that it would imitate in vain.
    script = Scripted(lm.tokenizer, [call("get_weather", city="Paris"), "Sunny."])
    session = (ChatSession.builder(lm).chat_template(PLAIN_CHATML).tools([get_weather])
               .generate_params(GenerateParams(max_tokens=60, logits_processors=[script])).build())
    with pytest.warns(UserWarning, match="does not render the tools"):
        assert session.respond("Weather in Paris?") == "Sunny."
    _, asked, result, _ = session.history
    prompt = session.render("And tomorrow?")
    assert call("get_weather", city="Paris") in prompt and '{"tool_calls"' not in prompt
    assert f"<|im_start|>tool\n{result.content}<|im_end|>" in prompt
    # What was rendered reads back as the same call, so the model could continue the pattern.
    from chatkit.text.reply import Segmenter

    segmenter = Segmenter(lm.tokenizer)
    segmenter.feed(prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0], final=True)
    assert [(c.name, c.arguments) for c in segmenter.tool_calls] == [(c.name, c.arguments) for c in asked.tool_calls]
    assert_ledger_matches_cache(session)
