"""Embedding in apps: async streaming and cancellation, threads, many sessions over one model, pools."""

import asyncio
import threading

from chatkit import GenerateParams, InvalidParamsError, SessionBusyError, SessionPool, SpeculativeConfig

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, fresh_reply, session_for


def endless(lm, max_tokens=400):
    """Params under which a reply never ends by itself (no end-of-turn token)."""
    return GenerateParams(max_tokens=max_tokens, logit_bias={i: -1e9 for i in lm.tokenizer.eos_token_ids})


def test_async_stream_matches_the_sync_reply(tiny):
    lm = tiny()
    session = session_for(lm, params=GenerateParams(max_tokens=12))
    expected = fresh_reply(session, "Hi")

    async def main():
        chunks = []
        async with session.astream_respond("Hi") as stream:
            async for chunk in stream:
                chunks.append(chunk)
        return stream, chunks

    stream, chunks = asyncio.run(main())
    assert [c.token for c in chunks] == expected
    assert "".join(c.text for c in chunks) == stream.text == session.history[-1].content
    assert asyncio.run(session.arespond("Again")) == session.history[-1].content
    assert_ledger_matches_cache(session)


def test_cancelling_the_task_stops_within_a_decode_step_and_commits(tiny):
    lm = tiny()
    session = session_for(lm, params=endless(lm))
    seen = []

    async def consume():
        async with session.astream_respond("Talk forever") as stream:
            async for chunk in stream:
                seen.append(chunk)
                if len(seen) == 10:
                    asyncio.current_task().cancel()

    async def main():
        task = asyncio.create_task(consume())
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not session.busy, "leaving the async with block waited for the commit"
    stats = session.last_stats
    assert stats.finish_reason == "cancelled"
    assert 10 <= stats.generation_tokens <= 12, "generation stopped within a decode step of the cancel"
    # The reply holds what was shown, plus at most the token being computed when the cancel came.
    assert session.history[-1].content.startswith("".join(c.text for c in seen))
    assert_ledger_matches_cache(session)


def test_the_worker_stays_a_few_chunks_ahead_of_a_slow_consumer(tiny):
    from chatkit.session.aio import LOOKAHEAD

    lm = tiny()
    session = session_for(lm, params=endless(lm))

    async def main():
        shown = []
        async with session.astream_respond("Talk slowly") as stream:
            async for chunk in stream:
                shown.append(chunk.text)
                await asyncio.sleep(0.05)  # a slow UI: 20 decode steps could run meanwhile
                if len(shown) == 3:
                    break
        return "".join(shown)

    shown = asyncio.run(main())
    assert 3 <= session.last_stats.generation_tokens <= 3 + LOOKAHEAD
    assert session.history[-1].content.startswith(shown)
    assert_ledger_matches_cache(session)


def test_a_dropped_async_stream_stops_and_commits(tiny):
    import gc

    lm = tiny()
    session = session_for(lm, params=endless(lm))

    async def main():
        stream = session.astream_respond("Talk forever")
        async for _ in stream:
            break  # no async with, no aclose: the stream is simply dropped
        del stream
        gc.collect()
        for _ in range(200):
            if not session.busy:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not session.busy and session.last_stats.finish_reason == "cancelled"
    assert session.last_stats.generation_tokens <= 1 + 2 * 2
    assert_ledger_matches_cache(session)


def test_cancel_from_outside_while_the_event_loop_stays_responsive(tiny):
    lm = tiny()
    session = session_for(lm, params=endless(lm, 2000))

    async def main():
        ticks = 0
        received = 0

        async def consume():
            nonlocal received
            async for _ in session.astream_respond("Go"):
                received += 1

        task = asyncio.create_task(consume())
        for _ in range(20):  # the loop keeps running while tokens are generated on the worker
            await asyncio.sleep(0.005)
            ticks += 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        at_cancel = received
        for _ in range(200):
            if not session.busy:
                break
            await asyncio.sleep(0.01)
        return ticks, at_cancel

    ticks, at_cancel = asyncio.run(main())
    assert ticks == 20 and not session.busy
    assert session.last_stats.generation_tokens <= at_cancel + 3
    assert session.last_stats.generation_tokens < 2000


def test_aclose_before_iterating_changes_nothing(tiny):
    session = session_for(tiny())

    async def main():
        stream = session.astream_respond("Never")
        await stream.aclose()

    asyncio.run(main())
    assert session.history == [] and not session.busy


def test_async_errors_roll_back(tiny):
    lm = tiny()

    def explode(tokens, logits):
        raise ValueError("bad processor")

    session = session_for(lm, params=GenerateParams(max_tokens=5, logits_processors=[explode]))
    with pytest.raises(ValueError, match="bad processor"):
        asyncio.run(session.arespond("Hi"))
    assert session.history == [] and not session.busy


def test_threads_hammering_one_session_one_wins_each_turn(tiny):
    session = session_for(tiny(), params=GenerateParams(max_tokens=6))
    wins, busy = [], []
    barrier = threading.Barrier(6)

    def worker(i):
        barrier.wait()
        for round_ in range(3):
            try:
                session.respond(f"thread {i} round {round_}")
                wins.append(i)
            except SessionBusyError:
                busy.append(i)
        mx.clear_streams()  # what MLX asks of a thread that ran MLX work, before it ends

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(wins) + len(busy) == 18 and wins and busy
    history = session.history
    assert len(history) == 2 * len(wins)
    assert all(m.role.value == ("user" if k % 2 == 0 else "assistant") for k, m in enumerate(history))
    assert_ledger_matches_cache(session)


def conversation(lm, i, out, in_thread=False):
    session = session_for(lm, params=GenerateParams(max_tokens=10), instructions=f"You are bot {i}.")
    for prompt in ["Hi", "Tell me more", "Why?"]:
        with session.stream_respond(prompt) as stream:
            out.append(tuple(c.token for c in stream))
    if in_thread:
        mx.clear_streams()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_many_sessions_on_one_model_in_threads_equal_one_by_one(tiny, arch):
    lm = tiny(arch=arch, tokenizer="bpe")
    alone = {i: [] for i in range(4)}
    for i in range(4):
        conversation(lm, i, alone[i])
    together = {i: [] for i in range(4)}
    threads = [threading.Thread(target=conversation, args=(lm, i, together[i], True)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert together == alone


def test_many_async_sessions_interleaved_equal_one_by_one(tiny):
    lm = tiny()
    sessions = [session_for(lm, params=GenerateParams(max_tokens=10), instructions=f"Bot {i}") for i in range(3)]
    expected = [fresh_reply(s, "Hello") for s in sessions]

    async def main():
        async def one(s):
            async with s.astream_respond("Hello") as stream:
                return [c.token async for c in stream]

        return await asyncio.gather(*(one(s) for s in sessions))

    assert asyncio.run(main()) == expected


def test_release_cache_frees_memory_and_the_next_turn_reprefills(tiny):
    session = session_for(tiny(), params=GenerateParams(max_tokens=6))
    session.respond("Hi")
    assert session.cache_info().nbytes > 0
    session.release_cache()
    assert session.cache_info().nbytes == 0 and len(session.history) == 2
    expected = fresh_reply(session, "Again")
    with session.stream_respond("Again") as stream:
        list(stream)
    assert stream.tokens == expected and session.last_stats.reused_tokens == 0


def test_pool_evicts_least_recently_used_caches_and_restores_them(tiny, tmp_path):
    lm = tiny()
    one = session_for(lm, params=GenerateParams(max_tokens=6))
    one.respond("Hello from a")
    budget = int(one.cache_info().nbytes * 2.5)  # room for two caches
    pool = SessionPool(
        lm, folder=tmp_path, max_cache_bytes=budget,
        configure=lambda b: b.instructions("Be brief.").generate_params(GenerateParams(max_tokens=6)),
    )
    for key in ["a", "b", "c"]:
        pool.session(key).respond(f"Hello from {key}")
    pool.session("c")  # enforce the budget: "a" is the least recently used
    assert pool.evicted("a") and not pool.evicted("b") and not pool.evicted("c")
    assert pool.cache_bytes() <= budget and pool.path("a").exists()
    history_a = pool.session("a").history
    assert len(history_a) == 2 and pool.session("a").cache_info().tokens > 0
    assert not pool.evicted("a") and pool.cache_bytes() <= budget
    pool.session("b")
    pool.session("a")
    assert not pool.evicted("a") and not pool.evicted("b") and pool.cache_bytes() <= budget
    a = pool.session("a")
    expected = fresh_reply(a, "And now?")
    with a.stream_respond("And now?") as stream:
        list(stream)
    assert stream.tokens == expected and a.last_stats.reused_tokens > 0
    pool.remove("a")
    assert "a" not in pool and not pool.path("a").exists()


def test_pool_never_evicts_a_busy_session(tiny, tmp_path):
    lm = tiny()
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=0,
                       configure=lambda b: b.generate_params(GenerateParams(max_tokens=6)))
    pool.session("x").respond("Hi")
    stream = pool.session("x").stream_respond("More")
    next(stream)
    pool.session("y")
    assert not pool.evicted("x")
    stream.close()
    pool.session("y")
    assert pool.evicted("x")


def test_pool_adds_sessions_built_elsewhere_and_looks_them_up(tiny, tmp_path):
    lm = tiny()
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=0,
                       configure=lambda b: b.generate_params(GenerateParams(max_tokens=6)))
    assert pool.get("a") is None and "a" not in pool  # a look-up creates nothing
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    built = session_for(lm, params=GenerateParams(max_tokens=6), history=history)
    assert pool.add("a", built) is built and pool.get("a") is built and pool.session("a") is built
    built.respond("And?")
    pool.session("b").respond("Hi")  # a budget of 0: "a" goes to disk
    assert pool.evicted("a") and pool.get("a") is built and pool.evicted("a")  # get() restores nothing
    assert list(pool) == ["a", "b"]  # nor marks "a" as used
    # add() replaces: the fork goes on from the same cache, the evicted file is no longer "a"'s cache
    fork = pool.session("a").fork()
    assert pool.add("a", fork) is fork and not pool.evicted("a") and list(pool) == ["b", "a"]
    expected = fresh_reply(fork, "Once more")
    with fork.stream_respond("Once more") as stream:
        list(stream)
    assert stream.tokens == expected and fork.last_stats.reused_tokens > 0
    stream = fork.stream_respond("Busy now")
    next(stream)
    with pytest.raises(SessionBusyError, match="generating"):
        pool.add("a", built)  # never replaces a session in the middle of a turn
    stream.close()
    with pytest.raises(InvalidParamsError, match="pool's own model"):
        pool.add("c", session_for(tiny(seed=1)))
    assert "c" not in pool


def test_pool_with_speculative_sessions(tiny, tmp_path):
    lm = tiny()
    config = SpeculativeConfig(tiny(seed=1), 2)
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=0,
                       configure=lambda b: b.speculative(config).generate_params(GenerateParams(max_tokens=6)))
    pool.session("a").respond("Hi")
    pool.session("b")
    assert pool.evicted("a")
    a = pool.session("a")
    expected = fresh_reply(a, "Again")
    with a.stream_respond("Again") as stream:
        list(stream)
    assert stream.tokens == expected


def test_the_next_turn_waits_for_a_dropped_stream_to_commit(tiny):
    lm = tiny()
    session = session_for(lm, params=endless(lm, max_tokens=40))

    async def main():
        async for _ in session.astream_respond("Hello"):
            break  # dropped at once: it commits on its worker a moment later
        reply = await session.arespond("Again")  # waits for that commit instead of SessionBusyError
        stream = session.astream_respond("Once more")
        chunks = [chunk async for chunk in stream]
        with pytest.raises(StopAsyncIteration):  # an ended stream stays ended
            await stream.__anext__()
        return reply, chunks

    reply, chunks = asyncio.run(main())
    assert [m.content for m in session.history[1::2]][1:] == [reply, "".join(c.text for c in chunks)]
    assert session.history[0].content == "Hello" and session.history[2].content == "Again"
    assert_ledger_matches_cache(session)


@pytest.mark.slow  # a subprocess
def test_a_stream_kept_after_its_event_loop_ended_does_not_block_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "kept.py"
    script.write_text(
        "import asyncio, time\n"
        "from chatkit import ChatSession, GenerateParams\n"
        "from chatkit.testing import tiny_model\n"
        "lm = tiny_model()\n"
        "params = GenerateParams(max_tokens=100000, logit_bias={i: -1e9 for i in lm.tokenizer.eos_token_ids})\n"
        "session = ChatSession.builder(lm).generate_params(params).build()\n"
        "kept = []\n"
        "async def main():\n"
        "    kept.append(session.astream_respond('Talk forever'))\n"
        "    async for _ in kept[0]:\n"
        "        break\n"
        "asyncio.run(main())\n"
        "loop = asyncio.new_event_loop()  # and one never closed: the process must still exit\n"
        "session2 = ChatSession.builder(lm).generate_params(params).build()\n"
        "async def other():\n"
        "    kept.append(session2.astream_respond('Talk on'))\n"
        "    async for _ in kept[-1]:\n"
        "        break\n"
        "loop.run_until_complete(other())\n"
        "for _ in range(100):\n"
        "    if not session.busy:\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "print(session.busy, session.last_stats.finish_reason, session.last_stats.generation_tokens)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    busy, finish, generated = out.stdout.split()
    assert busy == "False" and finish == "cancelled" and int(generated) <= 1 + 2 * 2
