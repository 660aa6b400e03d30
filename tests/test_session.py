"""ChatSession end to end on offline tiny models: turns, streaming, commit on close, errors."""

import gc

from chatkit import (
    ChatKitError,
    ChatMessage,
    ChatSession,
    ContextWindowExceededError,
    GenerateParams,
    Role,
    SessionBusyError,
    TemplateError,
)
from chatkit.errors import InvalidMessageError, InvalidParamsError

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, cache_state, fresh_reply, session_for

COMBOS = [
    ("qwen3", "bpe"),
    ("llama", "spm"),
    ("gemma3_text", "gemma"),
    ("qwen3", "bpe-think"),
    ("llama", "bpe"),
]


@pytest.mark.parametrize("arch,tok", COMBOS)
def test_greedy_multi_turn_matches_a_fresh_session_and_reuses_the_cache(tiny, arch, tok):
    lm = tiny(arch=arch, tokenizer=tok)
    session = session_for(lm)
    previous_prompt = 0
    for i, prompt in enumerate(["Hello there!", "What is 2 + 2?", "Tell me more."]):
        expected = fresh_reply(session, prompt)
        with session.stream_respond(prompt) as stream:
            chunks = list(stream)
        assert stream.tokens == expected, f"turn {i}: cache reuse changed the reply"
        assert "".join(c.text for c in chunks) == stream.text == session.history[-1].content
        stats = session.last_stats
        assert stats.prompt_tokens == stats.reused_tokens + stats.prefilled_tokens
        assert stats.generation_tokens == len(expected)
        # At worst the cache rewinds to where the previous reply starts (it may re-tokenize differently).
        assert stats.reused_tokens >= previous_prompt - 2
        previous_prompt = stats.prompt_tokens
        assert_ledger_matches_cache(session)
    assert [m.role for m in session.history] == [Role.USER, Role.ASSISTANT] * 3


def test_prompt_extending_the_cache_prefills_only_new_tokens(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    # A stop-free greedy reply ends in <|im_end|>, which ChatML renders back unchanged.
    session = session_for(lm, params=GenerateParams(max_tokens=12, logit_bias={_id(lm, "<|im_end|>"): 30.0}))
    session.respond("Hi")
    before = session.cache_info().tokens
    prompt_ids = lm.tokenizer.encode(session.render("Next"), add_special_tokens=False)
    session.respond("Next")
    stats = session.last_stats
    assert stats.reused_tokens == before
    assert stats.prefilled_tokens == len(prompt_ids) - before


def _id(lm, token):
    return lm.tokenizer.convert_tokens_to_ids(token)


TEXT = "Grüße 😀 你好世界 🎉 ナ 🇫🇷 done"


def forcing(tokenizer, text):
    """A logits processor that makes the model say ``text``, then stop (random weights won't)."""
    target = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    state = {"n": 0}

    def processor(tokens, logits):
        i = min(state["n"], len(target) - 1)
        state["n"] += 1
        return mx.where(mx.arange(logits.shape[-1]) == target[i], 0.0, -1e9)[None]

    return processor


@pytest.mark.parametrize("tok", ["bpe", "spm", "gemma"])
def test_streaming_never_splits_multibyte_characters(tiny, tok):
    lm = tiny(arch="llama", tokenizer=tok)
    params = GenerateParams(max_tokens=80, temperature=1.0, seed=7, logits_processors=[forcing(lm.tokenizer, TEXT)])
    session = session_for(lm, params=params)
    with session.stream_respond("Say something international.") as stream:
        chunks = list(stream)
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == stream.text == TEXT == session.history[-1].content
    assert chunks[-1].finish_reason == "stop"
    assert sum(1 for c in chunks if c.text == "") > 0, "some chunks had to wait for the rest of a character"


def test_sampling_with_a_seed_is_reproducible(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    params = GenerateParams(max_tokens=16, temperature=1.0, seed=3)
    a = session_for(lm, params=params).respond("Hi")
    b = session_for(lm, params=params).respond("Hi")
    c = session_for(lm, params=params.copy(seed=4)).respond("Hi")
    assert a == b and a != c


def test_break_after_k_chunks_commits_what_was_shown_then_continues(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    session = session_for(lm, params=GenerateParams(max_tokens=30))
    shown = ""
    for k, chunk in enumerate(session.stream_respond("Count to ten.")):
        shown += chunk.text
        if k == 4:
            break
    gc.collect()
    assert not session.busy
    assert session.history == [ChatMessage.user("Count to ten."), ChatMessage.assistant(shown)]
    assert session.last_stats.finish_reason == "cancelled" and session.last_stats.generation_tokens == 5
    assert_ledger_matches_cache(session)
    expected = fresh_reply(session, "Go on.")
    with session.stream_respond("Go on.") as stream:
        list(stream)
    assert stream.tokens == expected


def test_close_before_iterating_changes_nothing(tiny):
    session = session_for(tiny())
    session.respond("Hi")
    history, info = session.history, session.cache_info()
    stream = session.stream_respond("Never read")
    stream.close()
    assert session.history == history and session.cache_info() == info and not session.busy
    assert stream.stats is None


def test_second_turn_while_streaming_is_refused_and_the_stream_goes_on(tiny):
    session = session_for(tiny(), params=GenerateParams(max_tokens=10))
    expected = fresh_reply(session, "First")
    with session.stream_respond("First") as stream:
        first = next(stream)
        for attempt in (
            lambda: session.respond("Second"),
            lambda: session.stream_respond("Second"),
            session.clear,
            session.undo,
            lambda: setattr(session, "instructions", "x"),
        ):
            with pytest.raises(SessionBusyError):
                attempt()
        rest = list(stream)
    assert [first.token] + [c.token for c in rest] == expected
    assert len(session.history) == 2
    session.respond("Second")  # free again
    assert len(session.history) == 4


def test_an_error_inside_generation_rolls_back_and_the_session_goes_on(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    session = session_for(lm, params=GenerateParams(max_tokens=10))
    session.respond("Hi")
    history, held = session.history, session.cache_info().tokens
    calls = {"n": 0}

    def explode(tokens, logits):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("processor failed")
        return logits

    session.generate_params.logits_processors = [explode]
    with pytest.raises(RuntimeError, match="processor failed"):
        session.respond("Crash now")
    assert session.history == history and not session.busy
    assert_ledger_matches_cache(session)
    session.generate_params.logits_processors = []
    expected = fresh_reply(session, "And now?")
    with session.stream_respond("And now?") as stream:
        list(stream)
    assert stream.tokens == expected
    # The cache outlived the failure: what it held of the history before the failed turn is reused.
    assert session.last_stats.reused_tokens >= held - 2


def test_stop_strings_cut_the_reply(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    free = session_for(lm, params=GenerateParams(max_tokens=40)).respond("Hi")
    assert len(free) > 6, free
    stop = free[4:6]
    cut = free[: free.index(stop)]
    session = session_for(lm, params=GenerateParams(max_tokens=40, stop=[stop]))
    assert session.respond("Hi") == cut
    assert session.history[-1].content == cut and session.last_stats.finish_reason == "stop"
    expected = fresh_reply(session, "More")
    with session.stream_respond("More") as stream:
        list(stream)
    assert stream.tokens == expected, "the cached tokens past the stop string were rewound"


def test_max_tokens_ends_with_length(tiny):
    session = session_for(tiny(), params=GenerateParams(max_tokens=3, logit_bias={0: 50.0}))
    with session.stream_respond("Hi") as stream:
        chunks = list(stream)
    assert len(chunks) == 3 and chunks[-1].finish_reason == "length"
    assert stream.stats.finish_reason == "length"


def test_tool_role_and_dict_prompts(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    session = session_for(lm)
    session.respond({"role": "user", "content": "What's the weather?"})
    session.respond('{"temp": 21}', role=Role.TOOL)
    assert [m.role for m in session.history] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert "<tool_response>" in session.render()


def test_template_override_tools_and_kwargs_reach_the_template(tiny, tmp_path):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% if mood is defined %}MOOD:{{ mood }}\n{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    path = tmp_path / "t.jinja"
    path.write_text(template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    session = (
        ChatSession.builder(lm)
        .chat_template(path)
        .tools(tools)
        .generate_params(GenerateParams(max_tokens=4, template_kwargs={"mood": "sunny"}))
        .build()
    )
    text = session.render("Hi")
    assert "TOOLS:get_weather;" in text and "MOOD:sunny" in text and text.endswith("<|im_start|>assistant\n")
    session.respond("Hi")
    assert len(session.history) == 2
    # The model's own template gets tools too.
    own = ChatSession.builder(lm).tools(tools).build()
    assert "get_weather" in own.render("Hi") and "<tools>" in own.render("Hi")


def test_thinking_kwarg_reaches_the_thinking_template(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe-think")
    session = session_for(lm, params=GenerateParams(max_tokens=4, template_kwargs={"enable_thinking": False}))
    assert session.render("Hi").endswith("<think>\n\n</think>\n\n")


def test_template_errors(tiny, tmp_path):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    broken = ChatSession.builder(lm).chat_template("{% for m in messages %}{{ m.content }").build()
    with pytest.raises(TemplateError, match="failed to render"):
        broken.respond("Hi")
    assert broken.history == [] and not broken.busy
    raising = ChatSession.builder(lm).chat_template("{{ raise_exception('no system role, sorry') }}").build()
    with pytest.raises(TemplateError, match="no system role, sorry"):
        raising.respond("Hi")
    with pytest.raises(TemplateError, match="Could not read"):
        ChatSession.builder(lm).chat_template(tmp_path / "missing.jinja")
    hf = lm.tokenizer._tokenizer
    saved, hf.chat_template = hf.chat_template, None
    try:
        with pytest.raises(TemplateError, match="no chat template"):
            ChatSession.builder(lm).build().respond("Hi")
    finally:
        hf.chat_template = saved


def test_spm_template_refusal_is_a_template_error_and_changes_nothing(tiny):
    lm = tiny(arch="llama", tokenizer="spm")
    session = session_for(lm, history=[ChatMessage.user("a"), ChatMessage.user("b")])
    with pytest.raises(TemplateError):
        session.respond("c")
    assert len(session.history) == 2


def test_context_window_is_checked_before_any_work(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    session = session_for(lm)
    session.respond("Hi")
    info = session.cache_info()
    with pytest.raises(ContextWindowExceededError) as err:
        session.respond("word " * (lm.context_length + 10))
    assert err.value.context_length == lm.context_length and err.value.prompt_tokens > lm.context_length
    assert session.cache_info() == info and len(session.history) == 2 and not session.busy


@pytest.mark.parametrize("bad", ["", "   ", None, 42, b"bytes", ["list"]])
def test_bad_prompts_raise_and_change_nothing(tiny, bad):
    session = session_for(tiny())
    with pytest.raises(InvalidMessageError):
        session.respond(bad)
    assert session.history == [] and not session.busy


def test_bad_roles_and_settings(tiny):
    lm = tiny()
    session = session_for(lm)
    with pytest.raises(InvalidMessageError, match="Unknown role"):
        session.respond("x", role="wizard")
    with pytest.raises(InvalidMessageError, match="assistant"):
        session.respond("x", role=Role.ASSISTANT)
    session.generate_params.temperature = -1
    with pytest.raises(InvalidParamsError, match="temperature"):
        session.respond("x")
    assert session.history == [] and not session.busy
    with pytest.raises(InvalidParamsError):
        ChatSession.builder(lm).max_kv_size(0).build()
    with pytest.raises(InvalidParamsError, match="rotating"):  # mlx-lm raised NotImplementedError mid-turn
        ChatSession.builder(lm).max_kv_size(64).kv_bits(4).build()
    with pytest.raises(InvalidParamsError):
        ChatSession.builder("not a model")
    with pytest.raises(ChatKitError):
        ChatSession.builder(lm).instructions("a").history([ChatMessage.system("b")]).build()


def test_builder_accepts_model_and_tokenizer_and_leading_system_message(tiny):
    lm = tiny()
    session = (
        ChatSession.builder(lm.model, lm.tokenizer._tokenizer)
        .history([{"role": "system", "content": "S"}, ChatMessage.user("Hi"), ChatMessage.assistant("Yo")])
        .generate_params(GenerateParams(max_tokens=3))
        .build()
    )
    assert session.instructions == "S" and len(session.history) == 2
    assert session.model.context_length == lm.context_length
    session.respond("Again")
    assert len(session.history) == 4


def test_instructions_and_params_changes_apply_next_turn(tiny):
    session = session_for(tiny(), params=GenerateParams(max_tokens=8))
    session.respond("Hi")
    session.instructions = None
    assert "Be brief." not in session.render("x")
    session.generate_params.max_tokens = 2
    expected = fresh_reply(session, "Again")
    with session.stream_respond("Again") as stream:
        list(stream)
    assert stream.tokens == expected and len(expected) <= 2


def test_a_session_is_composed_of_one_state_and_a_turn_factory_over_it(tiny):
    """Issue 45: no session base class; the setters write the one state the turn factory reads, and a fork
    gets a state (and factory) of its own."""
    assert ChatSession.__bases__ == (object,)
    session = session_for(tiny())
    assert session._turns.state is session._state and session._compactor is session._turns.compactor
    session.respond("Hi")
    other = session.fork()
    other.instructions = "Be long."
    assert other._turns.state is other._state is not session._state
    assert "Be long." in other.render() and "Be long." not in session.render()
    assert other.history == session.history


def test_clear_forgets_history_and_cache(tiny):
    session = session_for(tiny())
    session.respond("Hi")
    session.clear()
    assert session.history == [] and session.cache_info().tokens == 0
    assert session.instructions == "Be brief."


def test_cache_info_counts_what_a_rotating_cache_holds(tiny):
    """A full rotating cache keeps counting what scrolled out in its offset; cache_info() must not."""
    lm = tiny("qwen3", "bpe")
    session = session_for(lm, max_kv_size=24)
    seen = []
    for prompt in ["Hello there", "And a second message", "And a third one, longer than before"]:
        session.respond(prompt)
        info, layers = session.cache_info(), cache_state(session).layers
        held = {min(c.offset, c.max_size) for c in layers}
        assert len(held) == 1 and info.tokens == held.pop() <= 24
        assert len(cache_state(session).ledger) >= info.tokens  # the ledger still names every token fed
        seen.append(info.tokens)
    assert seen[-1] == 24 and len(cache_state(session).ledger) > 24  # the window is full and has rotated
