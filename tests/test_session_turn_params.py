"""A turn's own options: ``params=GenerateParams(...)`` and ``logits_processors=[...]`` on ``respond`` and its
siblings apply to that turn only; the session's own settings (``config``) are unchanged (invariant 12)."""

import asyncio

from chatkit import ChatSession, GenerateParams, InvalidParamsError

import mlx.core as mx
import pytest

OWN = GenerateParams(max_tokens=8, temperature=0.0)


def session_with(lm, params=OWN, history=()):
    return (ChatSession.builder(lm).instructions("Be brief.").generate_params(params).history(list(history))
            .prompt_cache(None).build())


def tokens_of(session, prompt, **options):
    with session.stream_respond(prompt, **options) as stream:
        list(stream)
    return stream.tokens


def test_a_turns_max_tokens_applies_to_it_alone_and_equals_a_session_built_with_it(tiny):
    lm = tiny()
    session = session_with(lm)
    config = session.config
    short = GenerateParams(max_tokens=3, temperature=0.0)
    got = tokens_of(session, "Hi there.", params=short)
    assert got == tokens_of(session_with(lm, short), "Hi there.")  # greedy: the same as a session built so
    assert len(got) == 3 < len(tokens_of(session_with(lm), "Hi there."))
    assert session.config == config and session.generate_params == OWN
    nxt = tokens_of(session, "Tell me more.")  # back to the session's own
    assert nxt == tokens_of(session_with(lm, OWN, session.history[:-2]), "Tell me more.")
    assert len(nxt) == 8


def test_a_turns_temperature_and_seed(tiny):
    lm = tiny()
    hot = GenerateParams(max_tokens=8, temperature=1.5, seed=7)
    session = session_with(lm)
    other = session.fork()
    sampled = tokens_of(session, "Hi there.", params=hot)
    assert sampled == tokens_of(session_with(lm, hot), "Hi there.")  # the seed makes it one answer
    assert sampled == tokens_of(other, "Hi there.", params=hot)
    assert sampled != tokens_of(session_with(lm), "Hi there.")  # not the greedy one
    again = session.fork()
    again.undo()
    assert tokens_of(again, "Hi there.") == tokens_of(session_with(lm), "Hi there.")  # the session's own: greedy


def test_a_turns_logits_processors_run_after_the_sessions_own(tiny):
    lm = tiny()
    seen = []

    def own(tokens, logits):
        seen.append("own")
        return logits

    def only(token):
        def processor(tokens, logits):
            seen.append("turn")
            return mx.where(mx.arange(logits.shape[-1]) == token, logits, -mx.inf)
        return processor

    session = session_with(lm, GenerateParams(max_tokens=4, temperature=0.0, logits_processors=[own]))
    assert tokens_of(session, "Hi.", logits_processors=[only(42)]) == [42] * 4
    assert seen[:2] == ["own", "turn"]
    assert list(session.generate_params.logits_processors) == [own]
    seen.clear()
    assert tokens_of(session, "Again.") != [42] * 4 and set(seen) == {"own"}
    assert tokens_of(session, "Hi.", params=GenerateParams(max_tokens=2), logits_processors=[only(7)]) == [7, 7]


def test_bad_turn_options_are_refused_before_any_work(tiny):
    session = session_with(tiny())
    session.respond("Hi.")
    history, info = session.history, session.cache_info()
    for bad in ({"params": {"max_tokens": 3}}, {"params": GenerateParams(max_tokens=0)},
                {"params": GenerateParams(temperature=-1.0)}, {"logits_processors": [1]},
                {"logits_processors": lambda t, x: x}, {"params": GenerateParams(logit_bias={10**9: 1.0})}):
        with pytest.raises(InvalidParamsError):
            session.stream_respond("More.", **bad)
        assert (session.history, session.cache_info(), session.busy) == (history, info, False)


def test_async_turns_take_them_too(tiny):
    lm = tiny()
    short = GenerateParams(max_tokens=2, temperature=0.0)
    session = session_with(lm)
    reply = asyncio.run(session.arespond("Hi there.", params=short))
    assert reply == session_with(lm, short).respond("Hi there.")
    assert session.last_stats.generation_tokens <= 2 and session.config.generate_params == OWN

    async def streamed():
        async with session.astream_respond("More.", params=short) as stream:
            async for _ in stream:
                pass
        return stream
    assert asyncio.run(streamed()).stats.generation_tokens <= 2
    assert session.respond("Once more.") and session.last_stats.generation_tokens == 8
