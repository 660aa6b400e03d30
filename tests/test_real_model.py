"""The real-model tier: SmolLM2-135M-Instruct from its GGUF file (fetched once through pip into the
user cache, converted once). Greedy, float32 (the variant the expected outputs pin)."""

import json
import subprocess
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams, IncompatibleCacheError

import pytest
from conftest import assert_ledger_matches_cache, fresh_reply

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
