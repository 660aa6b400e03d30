"""Issue 33, item 5: guided specs the matcher (llguidance) cannot serve are refused before the turn
with ``InvalidOutputSpecError``: a schema nested 3,000 deep (was ``RecursionError``), a regex like
``a{1000000}`` or a Lark rule repeated 100,000 times (they compiled, then failed at the reply's first
token with advice meant for a caller that does not apply the mask)."""

import chatkit.guided.spec as spec_module
from chatkit import GenerateParams, InvalidOutputSpecError
from chatkit.guided import output_spec

import pytest
from conftest import session_for


def _arrays(depth):
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "array", "items": node}
    return node


def _objects(depth):
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


TOO_DEEP = {"arrays 3,000 deep": _arrays(3000), "objects 3,000 deep": _objects(3000), "objects 300 deep": _objects(300)}
TOO_LARGE = {
    "a regex a{1000000}": {"regex": "a{1000000}"},
    "a regex (a{1000}){1000}": {"regex": "(a{1000}){1000}"},
    "a Lark rule repeated 100,000 times": {"grammar": 'start: "a"{100000}'},
    "a limit met 200 bytes into the reply": {"grammar": 'start: /[xy]{200}/ " " /a{1000000}/'},
}


@pytest.fixture
def lm(tiny):
    return tiny(tokenizer="bpe")


def _unchanged_and_usable(session, before):
    assert session.history == before and not session.busy
    assert session.respond("Pick.", regex="[ab]{3}") in {a + b + c for a in "ab" for b in "ab" for c in "ab"}


@pytest.mark.parametrize("case", list(TOO_DEEP))
def test_a_schema_nested_too_deep_is_refused_before_the_turn(lm, case):
    with pytest.raises(InvalidOutputSpecError, match="nested more than 100 levels"):
        output_spec(TOO_DEEP[case])
    session = session_for(lm)
    session.respond("Hi")
    before = session.history
    with pytest.raises(InvalidOutputSpecError, match="nested more than 100 levels"):
        session.respond("Fill it.", output=TOO_DEEP[case])
    _unchanged_and_usable(session, before)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TOO_LARGE))
def test_a_spec_beyond_the_matchers_limits_is_refused_before_the_turn(lm, case):
    with pytest.raises(InvalidOutputSpecError, match="more than guided generation .* can serve.*Simplify"):
        output_spec(**TOO_LARGE[case])
    session = session_for(lm)
    before = session.history
    with pytest.raises(InvalidOutputSpecError, match="Simplify"):
        session.respond("Go.", **TOO_LARGE[case])
    _unchanged_and_usable(session, before)


def test_a_limit_met_later_in_a_reply_fails_that_turn_with_the_same_advice(lm, monkeypatch):
    monkeypatch.setattr(spec_module, "PROBE_BYTES", 0)  # as if the limit lay beyond what is probed
    session = session_for(lm, params=GenerateParams(max_tokens=20))
    before = session.history
    with pytest.raises(InvalidOutputSpecError, match="more than guided generation .* can serve.*Simplify") as info:
        session.respond("Go.", regex="a{1000000}")
    assert "apply the constraint" not in str(info.value)
    _unchanged_and_usable(session, before)
