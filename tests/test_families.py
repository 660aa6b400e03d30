"""Each vendored template's family end to end: a test tokenizer with the family's special tokens, its real
template, its real reply format forced by a script. The reply is parsed into reasoning / answer / tool
calls, the loop runs the tool, the history holds the fields, the template renders them back, and each
turn reuses the cache up to the template's own prefix ceiling (a trim per turn at most, visible in
``TurnStats.plan``). The next turn equals a fresh session replaying the history (invariant 5)."""

import warnings

from chatkit import ChatSession, GenerateParams, Role
from chatkit.testing import FAMILIES as FAMILY_TOKENIZERS
from chatkit.testing.tokenizers import tokenizer_files

import pytest
from conftest import assert_ledger_matches_cache
from helpers.families import ANSWER, BY_NAME, CITY, FAMILIES, RESULT, get_weather, reuse_over_turns, session

NAMES = [f.name for f in FAMILIES]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # R1 and V3.1 never render tools: chatkit warns (tests/test_real_templates.py)
        warnings.filterwarnings("ignore", message="This chat template does not render the tools")
        yield


@pytest.mark.slow
def test_family_tokenizers_have_their_special_tokens_as_single_tokens():
    for name in FAMILY_TOKENIZERS:
        lm = BY_NAME[next(f.name for f in FAMILIES if f.tokenizer == name)].model()
        tok = lm.tokenizer
        files = tokenizer_files(name)
        assert files.eos_token_ids and tok.eos_token_id == files.eos_token_ids[0]
        assert set(files.eos_token_ids) <= set(tok.eos_token_ids)
        assert len(tok) == lm.config["vocab_size"]
        for token in tok.all_special_tokens:
            assert len(tok.encode(token, add_special_tokens=False)) == 1, (name, token)


@pytest.mark.parametrize("name", NAMES)
def test_the_family_format_is_parsed_the_loop_runs_and_the_template_renders_it_back(name):
    family = BY_NAME[name]
    lm = family.model()
    s = session(family, lm, family.script(lm))
    with s.stream_respond(f"What is the weather in {CITY}?") as stream:
        chunks = list(stream)
    assert stream.text == ANSWER and stream.rounds == 2
    user, asked, result, answer = s.history
    assert [(c.name, c.arguments, c.error) for c in asked.tool_calls] == [("get_weather", {"city": CITY}, None)]
    assert asked.content == "" and asked.reasoning == family.call_reasoning
    assert (result.role, result.content, result.name) == (Role.TOOL, RESULT, "get_weather")
    assert result.tool_call_id == asked.tool_calls[0].id
    assert (answer.content, answer.reasoning, answer.tool_calls) == (ANSWER, family.answer_reasoning, ())
    # No marker reaches the answer or the reasoning: only the family's words do.
    shown = "".join(c.text for c in chunks if c.kind in ("text", "reasoning"))
    assert not [t for t in lm.tokenizer.get_added_vocab() if t in shown], shown
    assert [c.kind for c in chunks].count("tool_result") == 1
    # The template renders the fields back: the call as the family writes it, the result, the answer.
    rendered = s.render("And tomorrow?")
    for text in (family.rendered_call, RESULT, ANSWER, "And tomorrow?"):
        assert text in rendered, f"{name} lost {text!r}"
    assert_ledger_matches_cache(s)


@pytest.mark.parametrize("name", NAMES)
def test_the_next_turn_equals_a_fresh_session_replaying_the_history(name):
    family = BY_NAME[name]
    lm = family.model()
    s = session(family, lm, family.script(lm))
    s.respond(f"What is the weather in {CITY}?")
    params = GenerateParams(max_tokens=6)
    s.generate_params = params  # the script is spent: free greedy decoding
    fresh = ChatSession.builder(lm).tools([get_weather]).history(s.history).generate_params(params).build()
    a, b = s.stream_respond("And tomorrow?"), fresh.stream_respond("And tomorrow?")
    for stream in (a, b):
        with stream:
            for _ in stream:
                pass
    assert a.tokens == b.tokens and a.rounds == b.rounds
    assert_ledger_matches_cache(s)


@pytest.mark.parametrize("name", NAMES)
def test_each_turn_reuses_the_cache_up_to_the_templates_own_prefix(name):
    """Three questions, each with a call, its result and an answer: every turn reuses exactly the prefix
    its prompt shares with what the cache holds (the prompt and reply before it); a turn whose template
    renders the past differently (dropped reasoning, a moved tools block, a call rendered otherwise
    than the model wrote it) trims back to that prefix once, and says so in its plan."""
    steps = reuse_over_turns(BY_NAME[name], exchanges=3)
    for step in steps[1:]:
        assert step.reused == step.shared, step
        assert step.plan == ("append" if step.shared == step.held else "trim"), step
    assert steps[0].plan == "rebuild" or steps[0].reused == 0
