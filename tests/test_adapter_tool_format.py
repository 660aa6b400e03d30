"""An adapter trained to write a tool-call format records it in its folder (``chatkit_tool_parser_type`` in
``adapter_config.json``), and a session using the adapter reads its calls in that format, whatever the
model was loaded with; other sessions over the same model keep the model's (issue 51, item 5)."""

import json

import chatkit
from chatkit import ChatKitError, ChatSession, GenerateParams, ModelLoadError
from chatkit.model.adapters import TOOL_FORMAT_KEY
from chatkit.testing import Scripted, random_adapter, tiny_model

import pytest

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@pytest.fixture(scope="module")
def lm():
    lm = tiny_model("qwen3", "spm")  # a tokenizer with no tool-call format of its own (as SmolLM2's)
    assert not lm.tokenizer.has_tool_calling
    return lm


@pytest.fixture(scope="module")
def adapters(lm, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-format")
    return {
        "hermes": chatkit.load_adapter(random_adapter(root / "hermes", lm, config_extra={TOOL_FORMAT_KEY: "json_tools"})),
        "plain": chatkit.load_adapter(random_adapter(root / "plain", lm)),
    }


def scripted(lm, replies=(CALL,)):
    return GenerateParams(max_tokens=200, temperature=0.0, logits_processors=[Scripted(lm.tokenizer, list(replies))])


def reply_of(session, prompt="Add 1 and 2."):
    """The committed reply to ``prompt``: (its text, its calls as (name, arguments))."""
    list(session.stream_respond(prompt))
    last = session.history[-1]
    return last.content, [(c.name, c.arguments) for c in last.tool_calls or ()]


def test_the_recorded_format_is_read_from_the_folder(adapters):
    assert adapters["hermes"].tool_parser_type == "json_tools"
    assert adapters["plain"].tool_parser_type is None


def test_a_session_whose_adapter_records_hermes_calls_parses_them(lm, adapters):
    session = ChatSession.builder(lm).generate_params(scripted(lm)).adapter(adapters["hermes"]).build()
    text, calls = reply_of(session)
    assert calls == [("add", {"a": 1, "b": 2})]
    assert "<tool_call>" not in (text or "")


@pytest.mark.parametrize("adapter", [None, "plain"])
def test_without_the_record_the_call_stays_text(lm, adapters, adapter):
    session = ChatSession.builder(lm).generate_params(scripted(lm)).adapter(adapter and adapters[adapter]).build()
    text, calls = reply_of(session)
    assert calls == []
    assert '"name": "add"' in text


def test_other_sessions_on_the_same_model_keep_its_parser(lm, adapters):
    tuned = ChatSession.builder(lm).generate_params(scripted(lm)).adapter(adapters["hermes"]).build()
    base = ChatSession.builder(lm).generate_params(scripted(lm)).build()
    assert reply_of(tuned)[1] == [("add", {"a": 1, "b": 2})]
    assert reply_of(base)[1] == []
    assert not lm.tokenizer.has_tool_calling  # the model's own tokenizer is untouched


def test_switching_adapters_switches_the_format(lm, adapters):
    session = ChatSession.builder(lm).generate_params(scripted(lm, [CALL] * 4)).build()
    assert reply_of(session)[1] == []
    session.adapter = adapters["hermes"]
    assert reply_of(session)[1] == [("add", {"a": 1, "b": 2})]
    session.set_adapter(adapters["hermes"], 0.5)  # another scale: the same format
    assert reply_of(session)[1] == [("add", {"a": 1, "b": 2})]
    session.adapter = None
    assert reply_of(session)[1] == []


def test_a_fork_and_a_restored_session_keep_the_format(lm, adapters, tmp_path):
    session = ChatSession.builder(lm).generate_params(scripted(lm, [CALL] * 3)).adapter(adapters["hermes"]).build()
    reply_of(session)
    assert reply_of(session.fork())[1] == [("add", {"a": 1, "b": 2})]
    session.save_cache(tmp_path / "s.safetensors")
    restored = (ChatSession.builder(lm).adapter(adapters["hermes"]).cache(tmp_path / "s.safetensors")
                .generate_params(scripted(lm)).build())
    assert restored.history[-1].tool_calls[0].name == "add"
    assert reply_of(restored)[1] == [("add", {"a": 1, "b": 2})]


@pytest.mark.filterwarnings("ignore:This chat template has no tool role")
def test_past_calls_are_rendered_back_in_the_adapter_format(lm, adapters):
    session = ChatSession.builder(lm).generate_params(scripted(lm, [CALL, "ok"])).adapter(adapters["hermes"]).build()
    reply_of(session)
    session.respond(chatkit.ChatMessage.tool("3", tool_call_id=session.history[-1].tool_calls[0].id))
    # the template has no tool format: chatkit writes the call in the adapter's, as the model wrote it
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in session.render("next")


@pytest.mark.parametrize("name", ["hermes-ish", "../json_tools", 5, ["json_tools"], "", "os"])
def test_an_unknown_format_is_refused_at_load_adapter(lm, tmp_path, name):
    folder = random_adapter(tmp_path / "bad", lm, config_extra={TOOL_FORMAT_KEY: name})
    with pytest.raises(ModelLoadError, match=f"{TOOL_FORMAT_KEY}.*not a tool-call format mlx-lm knows.*json_tools"):
        chatkit.load_adapter(folder)
    assert issubclass(ModelLoadError, ChatKitError)


def test_a_model_loaded_with_the_format_shares_its_tokenizer(adapters, tmp_path):
    from chatkit.model.switchable import ActiveAdapter
    from chatkit.session.builder import tool_tokenizer

    lm = tiny_model("qwen3", "bpe")  # mlx-lm reads Hermes calls for it already
    folder = random_adapter(tmp_path / "same", lm, config_extra={TOOL_FORMAT_KEY: "json_tools"})
    assert tool_tokenizer(lm, ActiveAdapter(chatkit.load_adapter(folder, lm))) is lm.tokenizer


def test_the_shipped_smollm2_adapter_records_its_format():
    config = json.loads((chatkit.demo.smollm2_adapter_path() / "adapter_config.json").read_text())
    assert config[TOOL_FORMAT_KEY] == chatkit.demo.SMOLLM2_TOOL_PARSER
    assert chatkit.load_adapter(chatkit.demo.smollm2_adapter_path()).tool_parser_type == "json_tools"


@pytest.mark.slow
def test_the_server_reads_calls_in_the_format_of_the_requested_adapter(lm, adapters):
    from chatkit.server import ServerConfig, start

    import httpx

    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    body = {"messages": [{"role": "user", "content": "Add 1 and 2."}], "tools": tools}
    config = ServerConfig(model_id="tiny", defaults=scripted(lm, [CALL, CALL]), adapters={"hermes": adapters["hermes"]})
    with start(lm, config) as running:
        tuned, base = (httpx.post(f"{running.url}/chat/completions", json={**body, "model": m}, timeout=60).json()
                       for m in ("tiny:hermes", "tiny"))
    call = tuned["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("add", {"a": 1, "b": 2})
    assert tuned["choices"][0]["finish_reason"] == "tool_calls"
    assert not base["choices"][0]["message"].get("tool_calls") and '"name": "add"' in base["choices"][0]["message"]["content"]
