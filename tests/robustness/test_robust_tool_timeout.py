"""Issue 33, item 6: a tool that never returns no longer hangs its session. ``tool_timeout=`` (default
60 s, ``None`` for none) fails the call (told to the model, or ``ToolExecutionError`` with
``errors="raise"``); ``close()`` from another thread stops the loop without waiting for a sync tool
(its thread is abandoned); the async loop cancels async tools. Every call keeps its result in the
history and the session is free and usable afterwards."""

import asyncio
import json
import threading
import time

from chatkit import ChatSession, GenerateParams, InvalidParamsError, Role, ToolExecutionError
from chatkit.testing import Scripted
from chatkit.tools import ToolOptions

import pytest

SHORT = 0.2  # seconds: the tests' timeout, far below how long the tools would take


class Slow:
    """A sync and an async tool that would run for minutes; ``started`` is set when one runs, and
    ``release`` lets an abandoned sync one end (at the test's teardown)."""

    def __init__(self):
        self.started = threading.Event()
        self.release = threading.Event()
        self.cancelled = threading.Event()

    def tools(self):
        def slow(city: str) -> str:
            """A lookup that never ends.

            Args:
                city: The city.
            """
            self.started.set()
            self.release.wait(300)
            return "late"

        async def aslow(city: str) -> str:
            """An async lookup that never ends.

            Args:
                city: The city.
            """
            self.started.set()
            try:
                await asyncio.sleep(300)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return "late"

        return [slow, aslow]


@pytest.fixture
def slow():
    s = Slow()
    yield s
    s.release.set()  # abandoned threads end


@pytest.fixture
def lm(tiny):
    return tiny(tokenizer="bpe-think")


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def session(lm, slow, replies, **options):
    script = Scripted(lm.tokenizer, replies)
    params = GenerateParams(max_tokens=60, logits_processors=[script])
    return ChatSession.builder(lm).tools(slow.tools(), **options).generate_params(params).build()


def _roles(s):
    return [m.role for m in s.history]


@pytest.mark.parametrize("tool", ["slow", "aslow"])
def test_a_call_that_times_out_is_told_to_the_model_and_the_loop_goes_on(lm, slow, tool):
    s = session(lm, slow, [call(tool, city="Oslo"), "It timed out."], tool_timeout=SHORT)
    t0 = time.monotonic()
    assert s.respond("Weather?") == "It timed out."
    assert time.monotonic() - t0 < 10
    user, asked, result, answer = s.history
    assert result.role is Role.TOOL and result.tool_call_id == asked.tool_calls[0].id
    left = "was cancelled" if tool == "aslow" else "was left running"
    assert result.content == f"Error: {tool} did not return within 0.2 s and {left}."
    assert not s.busy and not s.pending_tool_calls
    if tool == "aslow":
        assert slow.cancelled.wait(5)


def test_with_errors_raise_a_timeout_raises_and_the_session_stays_usable(lm, slow):
    s = session(lm, slow, [call("slow", city="Oslo"), "Hello."], tool_timeout=SHORT, errors="raise")
    with pytest.raises(ToolExecutionError, match="did not return within 0.2 s.*tool_timeout") as info:
        s.respond("Weather?")
    assert info.value.call.name == "slow" and not s.busy
    assert s.history[-1].tool_calls == (info.value.call,)  # the call stays, for the app to answer
    (pending,) = s.pending_tool_calls
    assert s.respond("unknown", role=Role.TOOL, tool_call_id=pending.id) == "Hello."


def test_close_from_another_thread_does_not_wait_for_a_sync_tool(lm, slow):
    s = session(lm, slow, [call("slow", city="Oslo"), "Fine."])  # the default timeout (60 s) is far away
    stream = s.stream_respond("Weather?")
    done = threading.Event()

    def consume():
        for _ in stream:
            pass
        done.set()

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert slow.started.wait(10)
    t0 = time.monotonic()
    stream.close()  # the tool would run for minutes
    assert time.monotonic() - t0 < 3 and done.wait(3)
    consumer.join(3)
    assert not s.busy and _roles(s) == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert s.history[-1].content == "Error: slow was stopped before it returned (was left running): the reply was closed."
    assert not s.pending_tool_calls
    assert s.respond("And now?") == "Fine."  # usable: the next turn runs


def test_the_async_loop_cancels_an_async_tool_when_its_task_is_cancelled(lm, slow):
    s = session(lm, slow, [call("aslow", city="Oslo"), "Fine."])  # the default timeout (60 s) is far away

    async def main():
        task = asyncio.ensure_future(s.arespond("Weather?"))
        while not slow.started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        finished, _ = await asyncio.wait({task}, timeout=5)  # the cancelled turn does not wait for the tool
        assert finished and task.cancelled()
        for _ in range(300):  # the worker records the stopped call and ends the loop
            if not s.busy:
                break
            await asyncio.sleep(0.01)
        return await s.arespond("And now?")

    t0 = time.monotonic()
    assert asyncio.run(main()) == "Fine."
    assert time.monotonic() - t0 < 10 and slow.cancelled.is_set()
    tool_result = s.history[2]
    assert tool_result.role is Role.TOOL and "stopped before it returned (was cancelled)" in tool_result.content


def test_aclose_of_an_async_loop_does_not_wait_for_a_sync_tool(lm, slow):
    s = session(lm, slow, [call("slow", city="Oslo"), "Fine."])  # the default timeout (60 s) is far away

    async def main():
        stream = s.astream_respond("Weather?")

        async def consume():
            async for _ in stream:
                pass

        consumer = asyncio.ensure_future(consume())
        while not slow.started.is_set():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await asyncio.wait_for(stream.aclose(), 5)  # returns once the loop has ended, without the tool
        elapsed = time.monotonic() - t0
        await asyncio.wait_for(consumer, 5)
        return elapsed, s.busy

    elapsed, busy = asyncio.run(main())
    assert elapsed < 3 and not busy
    assert _roles(s) == [Role.USER, Role.ASSISTANT, Role.TOOL] and not s.pending_tool_calls
    assert "stopped before it returned (was left running)" in s.history[-1].content


def test_tool_timeout_is_checked_when_given(lm):
    assert ToolOptions().timeout == 60.0
    for bad in (0, -1, "1", float("nan"), float("inf"), True):
        with pytest.raises(InvalidParamsError, match="tool_timeout"):
            ChatSession.builder(lm).tools([], tool_timeout=bad)
    ChatSession.builder(lm).tools([], tool_timeout=None).tools([], tool_timeout=2)
