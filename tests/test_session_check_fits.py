"""``ChatSession.check_fits`` / ``count_tokens``: a turn's context-window check and its prompt's size, asked
before any work (no prefill, no summary, nothing changes), agreeing with what the turn itself does."""

from chatkit import (
    ChatMessage,
    ChatSession,
    ContextPolicy,
    ContextWindowExceededError,
    GenerateParams,
    InvalidMessageError,
    InvalidParamsError,
    LoadedModel,
)

import pytest

PARAMS = GenerateParams(max_tokens=8, temperature=0.0)
WINDOW = 200


@pytest.fixture
def lm(tiny):
    base = tiny()
    return LoadedModel(base.model, base.tokenizer, {**base.config, "max_position_embeddings": WINDOW}, base.source)


def session_over(lm, policy=ContextPolicy.error()):
    return ChatSession.builder(lm).instructions("Be brief.").generate_params(PARAMS).context_policy(policy).build()


def state(session):
    return session.history, session.cache_info(), session.token_count, session.busy


def test_check_fits_raises_what_the_turn_raises_and_changes_nothing(lm):
    session = session_over(lm)
    session.respond("Hi there.")
    long = "word " * 250
    before = state(session)
    with pytest.raises(ContextWindowExceededError) as checked:
        session.check_fits(long)
    assert state(session) == before
    with pytest.raises(ContextWindowExceededError) as turned:
        session.respond(long)
    assert state(session) == before
    assert (checked.value.prompt_tokens, checked.value.context_length) == \
        (turned.value.prompt_tokens, turned.value.context_length) == (turned.value.prompt_tokens, WINDOW)


def test_check_fits_passes_what_the_turn_takes_and_counts_what_it_prefills(lm):
    session = session_over(lm)
    session.respond("Hi there.")
    assert session.check_fits("Tell me more.") is None
    total = session.token_count + session.count_tokens("Tell me more.")
    session.respond("Tell me more.")
    assert session.last_stats.prompt_tokens == total


def test_check_fits_at_the_edge_of_the_window(lm):
    """The last prompt that fits passes and the first that does not raises, by one word."""
    session = session_over(lm)
    fits = [n for n in range(100, 200, 4) if session.count_tokens("word " * n) + session.token_count < WINDOW]
    n = fits[-1]
    session.check_fits("word " * n)
    with pytest.raises(ContextWindowExceededError):
        session.check_fits("word " * (n + 4))
    session.respond("word " * n)  # the turn agrees: it fits


def test_check_fits_under_a_compacting_policy_counts_only_what_must_stay(lm):
    session = session_over(lm, ContextPolicy.rolling())
    for i in range(8):
        session.respond(f"Message {i}: tell me something about the colour number {i}.")
    prompt = "colours " * 60
    assert session.token_count + session.count_tokens(prompt) > WINDOW  # the turn must compact
    session.check_fits(prompt)  # dropping old exchanges makes room
    with pytest.raises(ContextWindowExceededError):
        session.check_fits("word " * 250)  # the exchange alone is too long
    history = session.history
    session.respond(prompt)
    assert session.last_stats.compacted and session.history[:len(history)] == history


def test_check_fits_takes_a_list_whose_last_message_is_answered(lm):
    session = session_over(lm)
    messages = [ChatMessage.user("word " * 100), ChatMessage.assistant("ok"), ChatMessage.user("word " * 100)]
    with pytest.raises(ContextWindowExceededError):
        session.check_fits(messages)
    session.check_fits(messages[:1])
    assert session.count_tokens(messages) > session.count_tokens(messages[:1])
    with pytest.raises(InvalidMessageError):
        session.check_fits([])
    with pytest.raises(InvalidMessageError):
        session.check_fits(42)
    with pytest.raises(InvalidMessageError):
        session.check_fits("   ")  # checked as the turn checks its prompt


def test_a_turns_own_params_are_checked_and_shape_the_room(lm):
    session = session_over(lm, ContextPolicy.rolling())
    with pytest.raises(InvalidParamsError):
        session.check_fits("Hi.", params=GenerateParams(max_tokens=0))
    with pytest.raises(InvalidParamsError):
        session.count_tokens("Hi.", params={"max_tokens": 8})
    assert session.count_tokens("Hi.", params=GenerateParams(max_tokens=50)) == session.count_tokens("Hi.")
    for max_tokens in (8, 190):  # the turn compacts to make room, or gets what is left: it does not refuse
        session.check_fits("word " * 120, params=GenerateParams(max_tokens=max_tokens))
    assert session.generate_params.max_tokens == 8
