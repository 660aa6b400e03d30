"""Text that cannot be stored (lone surrogates, keys no template takes) is refused where it enters
(issue 33, item 3): stop strings, template kwargs, instructions, a cache file's path. Nothing is run or
written first, and the session keeps working and saving."""

import os

import chatkit
from chatkit import CacheFileError, ChatSession, GenerateParams, InvalidMessageError, InvalidParamsError, TemplateError

import pytest
from conftest import session_for

PARAMS = GenerateParams(max_tokens=6)

BAD_PARAMS = {
    "stop-surrogate": dict(stop=["\ud800"]),
    "stop-one-surrogate-string": dict(stop="END\udcff"),
    "template-kwarg-value": dict(template_kwargs={"name": "a\ud800"}),
    "template-kwarg-nested": dict(template_kwargs={"user": {"names": ["x", "\udfff"]}}),
    "template-kwarg-key-surrogate": dict(template_kwargs={"\ud800": 1}),
    "template-kwarg-int-key": dict(template_kwargs={1: "one"}),
    "template-kwarg-cycle": dict(template_kwargs={"loop": (loop := [])}),
}
loop.append(loop)


@pytest.mark.parametrize("name", sorted(BAD_PARAMS))
def test_settings_that_cannot_be_stored_are_refused_where_they_enter(tiny, tmp_path, name):
    bad = BAD_PARAMS[name]
    with pytest.raises(InvalidParamsError, match="GenerateParams"):
        GenerateParams(**bad).validate()
    with pytest.raises(InvalidParamsError):
        GenerateParams.from_dict({**PARAMS.to_dict(), **bad})
    with pytest.raises(InvalidParamsError):
        ChatSession.builder(tiny()).generate_params(GenerateParams(**bad)).build()
    # Set on a live session (params are mutable): the next turn is refused before it runs, the
    # session is unchanged, and it saves once the setting is put right.
    session = session_for(tiny(), params=PARAMS)
    session.respond("Hi")
    history, info = session.history, session.cache_info()
    for key, value in bad.items():
        setattr(session.generate_params, key, value)
    with pytest.raises(InvalidParamsError):
        session.respond("Again")
    with pytest.raises(InvalidParamsError):
        session.save_cache(tmp_path / "x.safetensors")
    assert not os.listdir(tmp_path)
    assert session.history == history and session.cache_info() == info
    for key in bad:
        setattr(session.generate_params, key, getattr(PARAMS, key))
    session.respond("Again")
    session.save_cache(tmp_path / "x.safetensors")
    assert chatkit.inspect_cache(tmp_path / "x.safetensors").turns == 2


def test_unusual_but_storable_settings_still_save(tiny, tmp_path):
    # Template kwargs that are not JSON are saved as their str (as before); valid Unicode anywhere.
    params = GenerateParams(max_tokens=6, stop=["🙂", "ende\u0301"], template_kwargs={"when": object(), "ü": ["ß"]})
    session = session_for(tiny(), params=params)
    session.respond("Hi")
    session.save_cache(tmp_path / "ok.safetensors")
    saved = chatkit.inspect_cache(tmp_path / "ok.safetensors").generate_params
    assert saved["stop"] == ["🙂", "ende\u0301"] and saved["template_kwargs"]["ü"] == ["ß"]


def test_instructions_that_cannot_be_stored_are_refused(tiny):
    session = session_for(tiny(), params=PARAMS)
    with pytest.raises(InvalidMessageError, match="surrogate"):
        ChatSession.builder(tiny()).instructions("Be \ud800 brief.")
    with pytest.raises(InvalidMessageError, match="surrogate"):
        session.instructions = "Be \udcff brief."
    assert session.instructions == "Be brief."


@pytest.mark.parametrize("name", ["a\ud800.safetensors", "b\udcff.safetensors", os.fsencode("c\udcff.safetensors")])
def test_a_cache_path_that_is_not_unicode_is_a_cache_file_error(tiny, tmp_path, name):
    session = session_for(tiny(), params=PARAMS)
    session.respond("Hi")
    path = os.path.join(os.fsencode(tmp_path) if isinstance(name, bytes) else tmp_path, name)
    with pytest.raises(CacheFileError, match="UTF-8"):
        session.save_cache(path)
    assert not os.listdir(tmp_path)
    for read in (chatkit.inspect_cache, session.restore_cache, lambda p: ChatSession.builder(tiny()).cache(p).build()):
        with pytest.raises(CacheFileError, match="UTF-8"):
            read(path)
    assert session.respond("Again")


def test_a_chat_template_that_is_not_unicode_text_is_refused_at_build(tiny, tmp_path):
    lm = tiny()
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"{{ messages }}\xff\xfe")
    for template in ("{% for m in messages %}{{ m.content }}\ud800{% endfor %}", str(tmp_path / "x\ud800.jinja"), binary):
        with pytest.raises(TemplateError):
            ChatSession.builder(lm).chat_template(template).build()
