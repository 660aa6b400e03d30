"""``SessionConfig``: a session's settings as one frozen value, made by the builder, copied by ``fork()``,
kept by save/restore, and never changed by a turn's own options (invariant 12)."""

import dataclasses

from chatkit import (
    CacheOptions,
    ChatSession,
    ContextPolicy,
    GenerateParams,
    InvalidParamsError,
    SessionConfig,
)

import pytest

PARAMS = GenerateParams(max_tokens=6, temperature=0.0)


def built(lm, **extra):
    builder = (ChatSession.builder(lm).instructions("Be brief.").generate_params(PARAMS).max_kv_bytes(10**9)
               .context_policy(ContextPolicy.rolling()).prompt_cache(None))
    for name, value in extra.items():
        builder = getattr(builder, name)(value)
    return builder.build()


def test_the_builder_makes_one_frozen_config(tiny):
    session = built(tiny())
    config = session.config
    assert isinstance(config, SessionConfig)
    assert (config.instructions, config.generate_params, config.max_kv_bytes, config.context_policy.mode) == \
        ("Be brief.", PARAMS, 10**9, "rolling")
    assert config.prompt_cache is None and config.tools is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.instructions = "x"
    config.generate_params.max_tokens = 99  # a copy: the session's own are unchanged
    assert session.generate_params.max_tokens == session.config.generate_params.max_tokens == 6


def test_setters_replace_the_config_and_leave_an_old_one_as_it_was(tiny):
    session = built(tiny())
    before = session.config
    session.instructions = "Be long."
    session.generate_params = GenerateParams(max_tokens=3)
    session.context_policy = ContextPolicy.error()
    session.cache_options = CacheOptions(prefill_step_size=64)
    after = session.config
    assert (after.instructions, after.generate_params.max_tokens, after.context_policy.mode,
            after.cache_options.prefill_step_size) == ("Be long.", 3, "error", 64)
    assert (before.instructions, before.generate_params.max_tokens, before.context_policy.mode) == \
        ("Be brief.", 6, "rolling")
    assert after.cache_options == session.cache_options


def test_fork_copies_the_config_all_of_it(tiny):
    session = built(tiny(), tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    session.respond("Hi.")
    other = session.fork()
    assert other.config == session.config
    assert other.config.max_kv_bytes == 10**9 and other.context_window == session.context_window
    other.generate_params = GenerateParams(max_tokens=2)
    assert session.config.generate_params == PARAMS  # the copy is independent


def test_a_session_from_a_config_or_from_keywords(tiny):
    lm = tiny()
    session = built(lm)
    again = ChatSession(lm, session.config)
    assert again.config == session.config
    assert ChatSession.builder(lm).config(session.config).build().config == session.config
    assert ChatSession.builder(lm).config(session.config).instructions("Other.").build().config == \
        dataclasses.replace(session.config, instructions="Other.")
    kw = ChatSession(lm, instructions="Be brief.", generate_params=PARAMS, prompt_cache=None)
    assert (kw.config.instructions, kw.config.generate_params) == ("Be brief.", PARAMS)
    assert kw.respond("Hi.") == ChatSession(lm, kw.config).respond("Hi.")
    with pytest.raises(InvalidParamsError, match="instructionz"):
        ChatSession(lm, instructionz="x")
    with pytest.raises(InvalidParamsError):
        ChatSession(lm, "not a config")
    with pytest.raises(InvalidParamsError):
        ChatSession(lm, SessionConfig(context_policy="rolling"))
    with pytest.raises(InvalidParamsError):
        ChatSession.builder(lm).config({"instructions": "x"})


def test_save_and_restore_keep_the_configs_data(tiny, tmp_path):
    lm = tiny()
    session = built(lm, kv_bits=None)
    session.generate_params = GenerateParams(max_tokens=5, temperature=0.0, stop=("zz",))
    session.respond("Hi.")
    session.save_cache(tmp_path / "c.safetensors")
    restored = ChatSession.builder(lm).cache(tmp_path / "c.safetensors").prompt_cache(None).build()
    for name in ("instructions", "generate_params", "context_policy", "cache_options"):
        assert getattr(restored.config, name) == getattr(session.config, name), name
    assert restored.history == session.history
    mine = ChatSession.builder(lm).cache(tmp_path / "c.safetensors").generate_params(PARAMS).instructions("Mine.").build()
    assert (mine.config.instructions, mine.config.generate_params) == ("Mine.", PARAMS)  # the builder's win


def test_save_and_restore_keep_the_template_kv_budget_and_special_tokens(tiny, tmp_path):
    from chatkit.tools import ToolOptions

    lm = tiny()
    template = "{# the app's own #}" + lm.tokenizer.chat_template
    schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    builder = (ChatSession.builder(lm).generate_params(PARAMS).prompt_cache(None).chat_template(template)
               .tools([schema], tool_execution="manual", max_tool_rounds=3, tool_timeout=5.0)
               .max_kv_bytes(10**9).allow_special_in_content())
    session = builder.build()
    session.respond("Hi.")
    session.save_cache(tmp_path / "c.safetensors")
    restored = ChatSession.builder(lm).cache(tmp_path / "c.safetensors").prompt_cache(None).build()
    assert restored.config.chat_template == template and restored.config.max_kv_bytes == 10**9
    assert restored.config.tool_options == ToolOptions()  # not saved: they come with tools, which are given again
    assert restored.config.allow_special_in_content is True
    again = ChatSession.builder(lm).cache(tmp_path / "c.safetensors").prompt_cache(None).tools([schema]).build()
    assert again.config.chat_template == template and again.config.tool_options == ToolOptions()  # the builder's tools
    assert again.render("Next") == session.render("Next")  # the same template (and tools): the cache is reused
    again.respond("Next")
    assert again.last_stats.reused_tokens > 0
    mine = ChatSession.builder(lm).cache(tmp_path / "c.safetensors").max_kv_bytes(None).allow_special_in_content(False).build()
    assert (mine.config.max_kv_bytes, mine.config.allow_special_in_content) == (None, False)  # the builder's win
    assert mine.config.chat_template == template
