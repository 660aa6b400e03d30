"""Issue 51, item 2: nothing a user points chatkit at hangs it. A pipe (FIFO) where a folder should hold a
file (an adapter's config or weights, a model's files, a GGUF path, a chat template, the server's stored
responses and conversation list) is refused at once; a summarizer that never returns is abandoned after
``summary_timeout`` and the policy's ``fallback`` applies."""

import os
import shutil
import threading

import chatkit
from chatkit import ChatSession, ContextPolicy, GenerateParams, LoadedModel, SummaryError
from chatkit.errors import ModelLoadError, TemplateError
from chatkit.server import manifest
from chatkit.server.response_store import ResponseStore

import pytest

PARAMS = GenerateParams(max_tokens=8, temperature=0.0)


def returns_quickly(call, fifos, seconds=10.0):
    """``call()``'s result or exception, failing the test if it is still blocked after ``seconds`` (the
    FIFOs are then opened for writing and closed, so that the blocked read ends)."""
    box = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    if hung:
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
    assert not hung, f"blocked on a FIFO: {fifos}"
    return box


def fifo(path):
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def test_an_adapter_folder_holding_a_fifo_is_refused(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    pipe = fifo(folder / "adapter_config.json")
    box = returns_quickly(lambda: chatkit.load_adapter(folder), [pipe])
    assert isinstance(box.get("error"), ModelLoadError) and "not a regular file" in str(box["error"])
    pipe.unlink()
    (folder / "adapter_config.json").write_text('{"fine_tune_type": "lora", "num_layers": 1, '
                                                '"lora_parameters": {"rank": 2, "scale": 1.0}}')
    pipe = fifo(folder / "adapters.safetensors")
    box = returns_quickly(lambda: chatkit.load_adapter(folder), [pipe])
    assert isinstance(box.get("error"), ModelLoadError) and "not a regular file" in str(box["error"])


def test_a_model_folder_gguf_path_or_template_that_is_a_fifo_is_refused(tmp_path):
    from chatkit.testing import tiny_model_path

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path(), folder)
    pipe = fifo(folder / "config.json")
    box = returns_quickly(lambda: chatkit.load(str(folder)), [pipe])
    assert isinstance(box.get("error"), ModelLoadError) and "not a regular file" in str(box["error"])
    lone = fifo(tmp_path / "model.gguf")
    box = returns_quickly(lambda: chatkit.load(str(lone)), [lone])
    assert isinstance(box.get("error"), ModelLoadError)
    template = fifo(tmp_path / "template.jinja")
    box = returns_quickly(lambda: ChatSession.builder(chatkit.load("demo")).chat_template(template).build(), [template])
    assert isinstance(box.get("error"), TemplateError)


def test_a_store_holding_fifos_starts(tmp_path):
    pipe = fifo(tmp_path / "resp_0123.json")
    box = returns_quickly(lambda: ResponseStore(tmp_path), [pipe])
    assert "error" not in box and len(box["value"]) == 0
    listing = fifo(tmp_path / manifest.MANIFEST)
    box = returns_quickly(lambda: manifest.read(tmp_path), [listing])
    assert box.get("value") == ([], {}, {})


def small(lm):
    return LoadedModel(lm.model, lm.tokenizer, {**lm.config, "max_position_embeddings": 320}, lm.source)


@pytest.mark.slow
def test_a_summarizer_that_never_returns_is_abandoned_for_the_fallback(tiny):
    lm, release = small(tiny()), threading.Event()

    def stuck(messages):
        release.wait(60)
        return "never used"

    prompts = [f"Message number {i}: tell me something about the colour {i}." for i in range(30)]
    try:
        for fallback in ("rolling", "wait"):
            policy = ContextPolicy.summarize(summarizer=stuck, fallback=fallback, summary_timeout=0.3)
            session = ChatSession.builder(lm).generate_params(PARAMS).context_policy(policy).build()

            def talk(session=session):
                for prompt in prompts:
                    session.respond(prompt)
                    if session.last_stats.compacted:
                        return session
            box = returns_quickly(talk, [], seconds=60)
            if fallback == "rolling":
                assert box["value"].last_stats.compacted and session.dropped_messages
                assert session._state.conversation.window.summary is None  # dropped without a summary
            else:
                assert isinstance(box.get("error"), SummaryError) and "summary_timeout" in str(box["error"])
                assert not session.busy
    finally:
        release.set()


def test_summary_timeout_is_checked_and_saved():
    with pytest.raises(chatkit.InvalidParamsError):
        ContextPolicy.summarize(summary_timeout=0)
    policy = ContextPolicy.summarize(summary_timeout=5)
    assert ContextPolicy.from_dict(policy.to_dict()) == policy
