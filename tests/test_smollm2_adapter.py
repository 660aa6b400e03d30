"""chatkit's LoRA adapter for SmolLM2-135M-Instruct (chatkit/demo/models/smollm2-tools, trained by
scripts/train_smollm2_adapter.py): the folder as shipped, and the real-model tier through a tool round,
a recall and ``chatkit chat --model smollm2``."""

import io
import json
import warnings

import chatkit
from chatkit import ChatSession, GenerateParams
from chatkit.cli.args import parser
from chatkit.demo import calculate

import pytest

GREEDY = GenerateParams(max_tokens=48, temperature=0.0)
# SmolLM2's template renders no tool schemas (the adapter learnt calculate without them): chatkit warns.
pytestmark = pytest.mark.filterwarnings("ignore:This chat template does not render the tools")


def test_the_shipped_adapter_folder_reads_and_names_its_tool_format():
    folder = chatkit.demo.smollm2_adapter_path()
    adapter = chatkit.load_adapter(folder)
    assert (adapter.kind, adapter.name) == ("lora", "smollm2-tools")
    assert all(k.startswith("model.layers.") for k in adapter.keys)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["chatkit_tool_parser_type"] == chatkit.demo.SMOLLM2_TOOL_PARSER
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapters.safetensors"]


def test_no_adapter_is_a_chat_flag():
    assert parser().parse_args(["chat", "--model", "smollm2", "--no-adapter"]).no_adapter
    assert not parser().parse_args(["chat", "--model", "smollm2"]).no_adapter


def test_no_adapter_is_refused_where_it_means_nothing(capsys):
    from chatkit.cli import main as cli_main

    assert cli_main(["chat", "--no-adapter"]) == 2  # the demo model has no default adapter
    assert "--no-adapter only applies with --model smollm2" in capsys.readouterr().err
    assert cli_main(["chat", "--model", "smollm2", "--no-adapter", "--adapter", "x"]) == 2
    assert "contradict" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tuned():
    lm = chatkit.load("smollm2")  # no tool_parser_type: the adapter brings the format it writes (issue 51)
    assert not lm.tokenizer.has_tool_calling
    return lm, lm.adapter(chatkit.demo.smollm2_adapter_path())


def session(tuned) -> ChatSession:
    lm, adapter = tuned
    return ChatSession.builder(lm).generate_params(GREEDY).tools(chatkit.demo.tools()).adapter(adapter).build()


@pytest.mark.real_model
@pytest.mark.slow
def test_the_tuned_model_calls_calculate_and_answers_from_the_result(tuned):
    s = session(tuned)
    reply = s.respond("What is 4821 + 367?")
    calls = [c for m in s.history for c in m.tool_calls]
    assert [c.name for c in calls] == ["calculate"]
    assert calculate(calls[0].arguments["expression"]) == "5188"
    assert [m.content for m in s.history if m.role.value == "tool"] == ["5188"]  # the tool loop ran it
    assert "5188" in reply


@pytest.mark.real_model
@pytest.mark.slow
def test_the_tuned_model_recalls_a_fact_and_says_what_it_was_not_told(tuned):
    s = session(tuned)
    s.respond("You can call me Rosalind.")
    assert "Rosalind" in s.respond("What is my name?")
    assert "know" in s.respond("Where do I live?").lower()
    assert not [c for m in s.history for c in m.tool_calls]


@pytest.mark.real_model
@pytest.mark.slow
def test_chat_with_smollm2_uses_the_adapter_and_the_calculator_unless_told_not_to():
    from chatkit.cli.repl import Repl

    with warnings.catch_warnings(record=True) as caught:  # SmolLM2 renders no tool schemas: expected, not warned
        warnings.simplefilter("always")  # over this module's filter: the chat command must silence it itself
        tuned = Repl(parser().parse_args(["chat", "--model", "smollm2"]), out=io.StringIO(), err=io.StringIO())
        tuned.session.render("What is 2 + 2?")
    assert not [w for w in caught if "does not render the tools" in str(w.message)]
    assert tuned.session.adapter is not None and tuned.session.adapter.name == "smollm2-tools"
    assert tuned.lm.tokenizer.has_tool_calling
    assert [t["function"]["name"] for t in tuned.session.tools or []] == ["calculate"]
    plain = Repl(parser().parse_args(["chat", "--model", "smollm2", "--no-adapter"]), out=io.StringIO(), err=io.StringIO())
    assert plain.session.adapter is None and not plain.lm.tokenizer.has_tool_calling and plain.session.tools is None
