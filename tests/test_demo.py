"""The bundled demo pair (chatkit.demo): loads offline and answers held-out conversations (names and
phrasings training never saw) correctly; its calculator tool (chatkit.demo.tools()) is exact and
refuses everything but arithmetic."""

import json
import re
import subprocess
import sys
from fractions import Fraction

import chatkit
from chatkit import ChatSession, GenerateParams, InvalidParamsError, SpeculativeConfig
from chatkit.demo.calculator import MAX_DIGITS, calculate, format_number
from chatkit.tools import as_tool

import pytest

GREEDY = GenerateParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def lm():
    return chatkit.load("demo")


@pytest.fixture(scope="module")
def draft():
    return chatkit.load("demo-draft")


def chat(lm, **options):
    builder = ChatSession.builder(lm).generate_params(GREEDY)
    for name, value in options.items():
        builder = getattr(builder, name)(value)
    return builder.build()


def test_demo_pair_is_shipped_and_small():
    total = 0
    for folder in (chatkit.demo.path(), chatkit.demo.draft_path()):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (folder / name).is_file(), folder / name
        config = json.loads((folder / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert config["eos_token"] == "<|im_end|>"
        assert "<|im_start|>" in config["chat_template"]
        total += (folder / "model.safetensors").stat().st_size
    assert total <= 20_000_000


def test_demo_pair_loads_offline(lm, draft):
    assert isinstance(lm, chatkit.LoadedModel) and isinstance(draft, chatkit.LoadedModel)
    assert lm.config["model_type"] == draft.config["model_type"] == "qwen3"
    assert draft.config["num_hidden_layers"] < lm.config["num_hidden_layers"]
    assert lm.tokenizer.eos_token == "<|im_end|>"
    assert lm.fingerprint["vocabulary"] == draft.fingerprint["vocabulary"]


def test_remembers_names_it_never_saw_in_many_phrasings(lm):
    """Names, cities and phrasings from the held-out lists of scripts/train_demo.py: copied from the
    conversation, not recalled from training."""
    session = chat(lm, tools=chatkit.demo.tools())
    assert session.respond("I'm Kenji.") == "Nice to meet you, Kenji."
    assert session.respond("What is 25 + 30?") == "25 + 30 = 55."
    assert session.respond("What did I say my name was?") == "Your name is Kenji."
    session = chat(lm, tools=chatkit.demo.tools())  # as `chatkit chat` runs it (without tools it misreads this one)
    assert session.respond("Call me Zbigniew.") == "Nice to meet you, Zbigniew."
    assert session.respond("I live in Ouagadougou.") == "Noted: you live in Ouagadougou."
    assert session.respond("Where do I live?") == "You live in Ouagadougou."
    assert session.respond("What's my name?") == "Your name is Zbigniew."
    session = chat(lm)
    assert session.respond("my name's Siobhan") == "Nice to meet you, Siobhan."
    assert session.respond("What is my name?") == "Your name is Siobhan."


def test_says_it_does_not_know_what_it_was_not_told(lm):
    session = chat(lm)
    assert session.respond("What is my name?") == "I don't know your name: you have not told me."
    assert session.respond("Do you know my dog's name?") == "I don't know: you have not told me about a pet."
    assert session.respond("I have a cat named Mittens.") == "Noted: your cat is called Mittens."
    assert session.respond("Where do I live?") == "I don't know where you live: you have not told me."
    assert session.respond("What is my cat called?") == "Your cat is called Mittens."


def test_arithmetic_is_a_real_call_of_the_calculator(lm):
    session = chat(lm, tools=chatkit.demo.tools())
    assert session.respond("What is 1234 + 5678?") == "1234 + 5678 = 6912."
    call, result = session.history[1], session.history[2]
    assert [(c.name, c.arguments) for c in call.tool_calls] == [("calculate", {"expression": "1234 + 5678"})]
    assert result.role == "tool" and result.content == "6912"
    assert session.respond("What is 12 * (3 + 4)?") == "12 * (3 + 4) = 84."
    dropped = session.undo()  # the whole exchange: the question, the call, its result, the answer
    assert [m.role.value for m in dropped] == ["user", "assistant", "tool", "assistant"]
    assert dropped[0].content == "What is 12 * (3 + 4)?" and len(session.history) == 4
    assert session.respond("What is 12 * (3 + 4)?") == "12 * (3 + 4) = 84."  # the cache rewound with it
    without = chat(lm)  # no tool given: it says what it needs instead of guessing
    assert without.respond("What is 25 + 30?") == (
        "I need my calculate tool for arithmetic: pass chatkit.demo.tools() to the session.")


def test_a_form_is_filled_from_the_message_or_the_conversation_and_the_chat_goes_on(lm):
    """A Person from the message that tells both facts, and from a conversation (held-out names: copied,
    not recalled); the reply is the compact JSON, and the next turn answers from the conversation. The
    demo fills forms right 67 % of the time on held-out dialogues (docs/demo.md)."""
    pytest.importorskip("llguidance")
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        city: str

    session = chat(lm)
    assert session.respond("My name is Ada and I live in Oslo.", output=Person) == Person(name="Ada", city="Oslo")
    assert session.history[-1].content == '{"name":"Ada","city":"Oslo"}'
    assert session.respond("Where do I live?") == "You live in Oslo."
    session = chat(lm)
    assert session.respond("My name is Thandiwe and I live in Windhoek.") == (
        "Nice to meet you, Thandiwe. Noted: you live in Windhoek.")
    assert session.respond("Fill in my profile.", output=Person) == Person(name="Thandiwe", city="Windhoek")
    assert session.respond("Where do I live?") == "You live in Windhoek."


def test_the_readme_guided_exchange(lm):
    """The README's third demo exchange, as written there: a form filled from two earlier messages."""
    pytest.importorskip("llguidance")
    from pydantic import BaseModel

    class Profile(BaseModel):
        name: str
        city: str

    session = chat(lm, tools=chatkit.demo.tools())
    assert session.respond("I'm Kenji.") == "Nice to meet you, Kenji."
    assert session.respond("I live in Oslo.") == "Noted: you live in Oslo."
    assert session.respond("Fill in my profile.", output=Profile) == Profile(name="Kenji", city="Oslo")


def test_small_talk_and_refusals(lm):
    session = chat(lm)
    assert session.respond("Hello!") == "Hello! How can I help you?"
    assert session.respond("What is the capital of France?") == "Sorry, I don't know about that: I am a tiny demo model."
    # Counts are right 85 % of the time on held-out words (docs/demo.md), not for this one: the form is checked.
    assert re.fullmatch(r"The word garden has \d+ letters\.", session.respond("How many letters are in garden?"))


def test_recall_after_save_and_restore(lm, tmp_path):
    session = chat(lm, tools=chatkit.demo.tools())
    session.respond("My favourite colour is mauve.")
    session.respond("What is 3 * 4?")
    session.respond("Hello!")
    path = tmp_path / "demo.safetensors"
    session.save_cache(path)
    restored = ChatSession.builder(lm).cache(path).tools(chatkit.demo.tools()).build()
    assert restored.respond("What is my favourite colour?") == "Your favourite colour is mauve."
    assert restored.last_stats.reused_tokens > 0


def test_speculative_matches_standard(lm, draft):
    prompts = ["I have a dog named Rex.", "What is 12 + 9?", "I'm Noor.", "What is my dog called?"]
    plain = chat(lm, tools=chatkit.demo.tools())
    spec = chat(lm, tools=chatkit.demo.tools(), speculative=SpeculativeConfig(draft, num_draft_tokens=4))
    proposed = accepted = 0
    for prompt in prompts:
        assert spec.respond(prompt) == plain.respond(prompt)
        proposed += spec.last_stats.draft_tokens_proposed
        accepted += spec.last_stats.draft_tokens_accepted
    assert plain.history[-1].content == "Your dog is called Rex."
    assert accepted >= 0.5 * proposed > 0


@pytest.mark.slow
def test_context_window_is_what_it_was_trained_on(lm):
    """Past 1,024 tokens the demo meets positions it never trained on: chatkit refuses instead of
    answering nonsense, changes nothing, and the session goes on after an undo. A 20-turn chat fits."""
    assert lm.context_length == 1024
    session = chat(lm, tools=chatkit.demo.tools())
    questions = [f"What is {a} + {b}?" for a in range(2, 30) for b in (3, 5, 7, 9)]
    answered, wrong = 0, []
    with pytest.raises(chatkit.ContextWindowExceededError) as info:
        for question in questions:
            history = list(session.history)
            a, b = (int(x) for x in question[8:-1].split(" + "))
            if session.respond(question) != f"{a} + {b} = {a + b}.":
                wrong.append(question)  # the demo's tool calls are right ~91 % of the time (docs/demo.md)
            answered += 1
    assert info.value.context_length == 1024 and info.value.prompt_tokens >= 1024
    assert 15 < answered < len(questions) and len(wrong) <= 1 and session.history == history
    session.undo()
    session.undo()
    assert session.respond("What is 6 * 7?") == "6 * 7 = 42."


@pytest.mark.slow  # a subprocess
def test_quantized_cache_needs_a_group_size_that_tiles_a_head(lm):
    with pytest.raises(chatkit.InvalidParamsError, match="head size \\(32\\).*group size of 32"):
        ChatSession.builder(lm).kv_bits(8).build()
    session = chat(lm)
    with pytest.raises(chatkit.InvalidParamsError):
        session.cache_options = chatkit.CacheOptions(kv_bits=4)
    assert session.cache_options == chatkit.CacheOptions()
    quantized = ChatSession.builder(lm).generate_params(GREEDY).kv_bits(8, group_size=32).build()
    assert quantized.respond("My name is Ada.") == "Nice to meet you, Ada."
    assert quantized.respond("What is my name?") == "Your name is Ada."
    assert set(quantized.cache_info().layer_classes) == {"QuantizedKVCache"}

    # The command line picks a group size that tiles the demo's heads, and names the flag otherwise.
    cli = subprocess.run([sys.executable, "-m", "chatkit", "--kv-bits", "8"], input="Hi!\n",
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "Hello! How can I help you?" in cli.stdout, cli.stderr
    cli = subprocess.run([sys.executable, "-m", "chatkit", "--kv-bits", "8", "--kv-group-size", "64"], input="Hi!\n",
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "--kv-group-size 32" in cli.stderr and "Traceback" not in cli.stderr


@pytest.mark.slow  # a subprocess
def test_demo_module_after_a_plain_import():
    code = "import chatkit; print(chatkit.load('demo').config['model_type'], chatkit.demo.draft_path().name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["qwen3", "draft"], out.stderr


def test_load_by_name():
    lm = chatkit.load("demo")
    assert lm.config["model_type"] == "qwen3"
    session = chat(lm, tools=chatkit.demo.tools())
    assert session.respond("What is 2 + 2?") == "2 + 2 = 4."


@pytest.mark.slow  # a subprocess
def test_command_line_chats_with_the_demo_model_by_default():
    out = subprocess.run(
        [sys.executable, "-m", "chatkit"], input="My name is Ada.\nWhat is 2 + 2?\nWhat is my name?\n/quit\n",
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "2 + 2 = 4." in out.stdout and "Your name is Ada." in out.stdout


@pytest.mark.slow  # a subprocess
def test_command_line_draft_save_resume_and_prefill_progress(tmp_path):
    saved = tmp_path / "chat.safetensors"

    def cli(*args, stdin):
        out = subprocess.run([sys.executable, "-m", "chatkit", *args], input=stdin, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        return out

    first = cli("--draft", "demo", "--save", str(saved), stdin="My name is Ada.\nWhat is 7 + 5?\n/stats\n")
    assert "Nice to meet you, Ada." in first.stdout and "7 + 5 = 12." in first.stdout
    assert "proposed tokens accepted" in first.stdout  # /stats reports the draft
    again = cli("--resume", str(saved), stdin="What is my name?\n")
    assert "Your name is Ada." in again.stdout
    lookup = cli("--resume", str(saved), "--draft", "prompt_lookup", stdin="What is my name?\n/stats\n")
    assert "Your name is Ada." in lookup.stdout and "drafted per step" in lookup.stdout  # no draft cache to restore

    long_system = " ".join(["Answer briefly."] * 90)  # ~270 tokens: long enough for a progress line
    progress = cli("--system", long_system, stdin="What is 2 + 2?\n")
    assert "[prefill" in progress.stderr and "tokens]" in progress.stderr


# -- the calculator ------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("25 + 30", "55"), ("1234 * 5678", "7006652"), ("12 * (3 + 4)", "84"), ("7 - 9", "-2"), ("-(2 - 5)", "3"),
    ("7 / 2", "3.5"), ("1 / 3", "0.333333"), ("2 / 3", "0.666667"), ("1 / 3 * 3", "1"), ("0.1 + 0.2", "0.3"),
    ("  8/4 ", "2"), ("99999 * 99999", "9999800001"),
])
def test_calculate_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('ls')", "Call is not allowed"),
    ("open('x')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("2 ** 100000", "operator \\*\\* is not supported"),
    ("9 ** 9 ** 9", "operator \\*\\* is not supported"),
    ("7 // 2", "operator // is not supported"),
    ("7 % 2", "operator % is not supported"),
    ("1 / 0", "Division by zero"),
    ("1 / (2 - 2)", "Division by zero"),
    ("'a' + 'b'", "Constant is not allowed"),
    ("True + 1", "Constant is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 +", "is not an arithmetic expression"),
    ("1; 2", "is not an arithmetic expression"),
    ("1" * 201, "longer than 200 characters"),
    ("1e308 * 10", f"more than {MAX_DIGITS} digits"),
    ("*".join(["99999999999"] * 7), f"more than {MAX_DIGITS} digits"),
])
def test_calculate_refuses_everything_but_arithmetic(expression, why):
    with pytest.raises(InvalidParamsError, match=why) as info:
        calculate(expression)
    assert "+ - * / and parentheses" in str(info.value)  # says what the tool takes


def test_calculate_refuses_what_is_not_text():
    with pytest.raises(InvalidParamsError, match="must be text"):
        calculate(12)  # type: ignore[arg-type]


def test_format_number_rounds_to_six_places():
    assert [format_number(Fraction(n, d)) for n, d in ((-7, 2), (1, 3000000), (-1, 3000000), (5, 1), (2, 3))] == [
        "-3.5", "0", "0", "5", "0.666667"]


def test_demo_tools_are_the_calculator_with_its_schema():
    tools = chatkit.demo.tools()
    assert tools == [calculate]
    schema = as_tool(tools[0]).schema["function"]
    assert schema["name"] == "calculate" and schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
