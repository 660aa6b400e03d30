"""Issue 33, item 9: guided output with a thinking template (the test tokenizer "bpe-think" has
Qwen3's <think> markers). With thinking off the reply cannot open a think block (before, it could,
and a model that likes to think spent every token there: ``IncompleteOutputError`` with 0
characters); with thinking on the reasoning is bounded by ``max_thinking_tokens``, by default half of
``max_tokens``, so the value always gets its room."""

from chatkit import GenerateParams

import pytest
from conftest import session_for

AGE = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["age"]}


@pytest.fixture
def lm(tiny):
    return tiny(tokenizer="bpe-think")


def _thinker(lm, **params):
    """A weak model that would think forever: a strong bias toward the <think> token."""
    think = lm.tokenizer.think_start_id
    return session_for(lm, params=GenerateParams(logit_bias={think: 60.0}, **params))


def _reasoning_length(lm, tokens):
    """Tokens between the reply's opening <think> and its </think> (None: no block)."""
    start, end = lm.tokenizer.think_start_id, lm.tokenizer.think_end_tokens[0]
    if tokens[:1] != [start]:
        return None
    return tokens.index(end) - 1


@pytest.mark.parametrize("off", [{"thinking": False}, {"template_kwargs": {"enable_thinking": False}}])
def test_with_thinking_off_a_guided_reply_cannot_open_a_think_block(lm, off):
    session = _thinker(lm, max_tokens=40, **off)
    assert session.render("A person").rstrip().endswith("</think>")  # the template closed an empty block
    with session.stream_respond("A person", output=AGE) as stream:
        for _ in stream:
            pass
    assert isinstance(stream.value["age"], int)
    assert lm.tokenizer.think_start_id not in stream.tokens
    assert not session.history[-1].reasoning


def test_with_thinking_on_the_reasoning_gets_a_default_budget_of_half_max_tokens(lm):
    session = _thinker(lm, max_tokens=40)
    with session.stream_respond("A person", output=AGE) as stream:
        for _ in stream:
            pass
    assert isinstance(stream.value["age"], int)
    assert _reasoning_length(lm, stream.tokens) == 20  # the model would go on: the budget ended it
    assert session.history[-1].reasoning


def test_with_thinking_on_max_thinking_tokens_bounds_the_reasoning(lm):
    session = _thinker(lm, max_tokens=40, max_thinking_tokens=5)
    with session.stream_respond("A person", output=AGE) as stream:
        for _ in stream:
            pass
    assert isinstance(stream.value["age"], int) and _reasoning_length(lm, stream.tokens) == 5
    assert isinstance(session.regenerate()["age"], int)  # the same spec, the same bound
