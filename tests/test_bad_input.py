"""Bad input to the public API (params, messages, tool calls, builder options, guided specs): chatkit's
own errors before anything runs, and the session unharmed."""

import typing

from chatkit import (
    ChatKitError,
    ChatMessage,
    ChatSession,
    GenerateParams,
    InvalidMessageError,
    InvalidOutputSpecError,
    InvalidParamsError,
    ToolCall,
)
from chatkit.testing import Scripted

import pytest
from conftest import session_for
from helpers.cachefiles import saved_chat, talk

PARAMS = GenerateParams(max_tokens=8)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    return saved_chat(tiny, tmp_path_factory)


# -- params that reach native code, stop strings from files, lone surrogates --------------------------
def test_logit_bias_top_k_and_seed_are_checked_against_the_model_before_anything_runs(tiny):
    lm = tiny()
    vocab = lm.vocab_size
    assert vocab == lm.model.args.vocab_size
    session = talk(lm)
    history, info = session.history, session.cache_info()
    for bad in (
        PARAMS.copy(logit_bias={vocab: 5.0}),
        PARAMS.copy(logit_bias={100_000: 5.0}),
        PARAMS.copy(top_k=vocab + 1),
        PARAMS.copy(top_k=vocab, temperature=1.0),  # mlx-lm's top-k needs fewer: it failed in compiled code
        PARAMS.copy(seed=-1),
        PARAMS.copy(seed=2**64),
    ):
        session.generate_params = bad
        with pytest.raises(InvalidParamsError):
            session.respond("Hello again")
        with pytest.raises(InvalidParamsError):
            session.regenerate()
        assert session.history == history and session.cache_info() == info and not session.busy
    session.generate_params = PARAMS.copy(logit_bias={vocab - 1: 1.0}, top_k=vocab - 1, seed=2**64 - 1, temperature=1.0)
    session.respond("Hello again")
    assert len(session.history) == 6


def test_stop_read_as_a_string_stays_one_stop_string():
    assert GenerateParams(stop="END").copy().stop == ("END",)  # not its letters
    params = GenerateParams()
    params.stop = "END"
    params.validate()
    assert params.to_dict()["stop"] == ["END"]
    assert GenerateParams.from_dict({"stop": "END"}).stop == ("END",)
    assert GenerateParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    with pytest.raises(InvalidParamsError):
        GenerateParams.from_dict({"stop": 5})
    with pytest.raises(InvalidParamsError):
        GenerateParams.from_dict(["stop"])


def test_a_lone_surrogate_is_an_invalid_message_error(tiny):
    session = session_for(tiny(), params=PARAMS)
    with pytest.raises(InvalidMessageError, match="surrogate"):
        session.respond("bad \ud800 text")
    with pytest.raises(InvalidMessageError, match="surrogate"):
        ChatMessage.tool("ok", name="\udfff")
    with pytest.raises(InvalidMessageError, match="surrogate"):
        session.instructions = "be \ud83d brief"
    assert session.history == [] and not session.busy


def test_saving_with_params_that_were_never_checked_is_an_invalid_params_error(tiny, tmp_path):
    session = talk(tiny())
    session.generate_params = GenerateParams(logit_bias=[1, 2])  # assigned, never used in a turn
    with pytest.raises(InvalidParamsError, match="logit_bias"):
        session.save_cache(tmp_path / "chat.safetensors")
    assert list(tmp_path.iterdir()) == []


# -- bad input found by probing the public API: chatkit's own errors, the session unharmed -----------
def test_params_of_the_wrong_type_or_size_are_invalid_params_errors_before_a_turn(tiny):
    session = talk(tiny())
    history = session.history
    for bad in (
        PARAMS.copy(repetition_penalty=1.1, repetition_context_size=10**12),  # past mlx's 32-bit slices
        PARAMS.copy(stop=None),
        PARAMS.copy(template_kwargs=None),
        PARAMS.copy(logits_processors=None),
        PARAMS.copy(logit_bias=[1, 2]),
    ):
        session.generate_params = bad
        with pytest.raises(InvalidParamsError):
            session.respond("Hello again")
        assert session.history == history and not session.busy
    with pytest.raises(InvalidParamsError):
        session_for(session.model, params=GenerateParams(stop=None))


@pytest.mark.parametrize(
    "data",
    [
        {"role": "assistant", "content": "x", "tool_calls": 5},
        {"role": "user", "content": "x", 1: 2, "z": 3},  # keys that do not sort together
        {"role": "assistant", "content": "", "tool_calls": [{1: 2, "a": 3}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "[" * 100_000}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"a": "\ud800"}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "\udfff", "arguments": {}}]},
    ],
)
def test_odd_message_dicts_are_invalid_message_errors(data):
    with pytest.raises(InvalidMessageError):
        ChatMessage.from_dict(data)


def test_tool_call_arguments_must_be_json_data():
    for arguments in ({"a": {1, 2}}, {"a": b"x"}, {(1, 2): 3}):
        with pytest.raises(InvalidMessageError, match="JSON"):
            ToolCall("abcdefghi", "f", arguments)
    with pytest.raises(InvalidMessageError):
        ChatMessage("assistant", "x", tool_calls=5)


def test_builder_options_of_the_wrong_type_are_refused(tiny):
    lm = tiny()
    builder = ChatSession.builder(lm)
    for call in (
        lambda: builder.history(None),
        lambda: builder.history(5),
        lambda: builder.prefill_progress(5),
        lambda: builder.cache("x.safetensors", verify="no"),
        lambda: ChatSession.builder(lm.model, "tokenizer"),
    ):
        with pytest.raises(ChatKitError):
            call()
    for tools in (5, [{"name": "f", "parameters": "x"}], [{"name": "f", "parameters": [1]}],
                  [{"name": "f", "description": "\ud800"}]):
        with pytest.raises(InvalidParamsError):
            builder.tools(tools)
    builder.history([ChatMessage.user("hi")]).prefill_progress(None).build()


def test_a_model_without_args_gets_its_vocabulary_from_its_logits(tiny):
    lm = tiny()

    class Bare:  # an mlx-lm-like model with no .args (what some custom models are)
        layers = lm.model.layers

        def __call__(self, *args, **kwargs):
            return lm.model(*args, **kwargs)

    session = ChatSession.builder(Bare(), lm.tokenizer).generate_params(PARAMS).build()
    assert session.model.vocab_size == lm.vocab_size
    assert session.respond("hi") == session_for(lm, params=PARAMS, instructions=None).respond("hi")


def test_guided_specs_with_lone_surrogates_or_empty_literals_are_output_spec_errors(tiny):
    session = session_for(tiny(), params=PARAMS)
    for spec in ({"regex": "\ud800"}, {"grammar": 'start: "\ud800"'}, {"output": typing.Literal[()]}):
        with pytest.raises(InvalidOutputSpecError):
            session.respond("hi", **spec)
    assert session.history == []


def test_a_tool_result_that_is_not_json_goes_back_to_the_model_as_an_error(tiny):
    lm = tiny(tokenizer="bpe-think")
    call = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'

    def lookup(q: str) -> str:
        """Look something up.

        Args:
            q: what to look up
        """
        return {(1, 2): 3}  # type: ignore[return-value]  (a tool that breaks its own hint)

    session = (ChatSession.builder(lm).tools([lookup])
               .generate_params(GenerateParams(max_tokens=40, logits_processors=[Scripted(lm.tokenizer, [call, "done"])]))
               .build())
    session.respond("go")
    result = next(m for m in session.history if m.role.value == "tool")
    assert result.content.startswith("Error: lookup returned a dict that is not JSON") and session.pending_tool_calls == []


def test_an_empty_tool_result_is_accepted_in_manual_mode(tiny):
    lm = tiny(tokenizer="bpe-think")
    call = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
    schema = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    session = (ChatSession.builder(lm).tools([schema], tool_execution="manual")
               .generate_params(GenerateParams(max_tokens=40, logits_processors=[Scripted(lm.tokenizer, [call, "done"])]))
               .build())
    session.respond("go")
    (pending,) = session.pending_tool_calls
    session.respond("", role="tool", tool_call_id=pending.id)
    assert session.history[-2].content == "" and session.pending_tool_calls == []
