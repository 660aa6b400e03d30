"""Issue 51, item 1: image bytes never reach a decoder beyond PNG, JPEG, WebP and GIF, nor any subprocess.

A fake ``gs`` (Ghostscript, which Pillow's EPS plugin runs on the bytes it is given) sits first on PATH and
records every call: PostScript sent as an image over chat completions, the Responses API, Anthropic's
Messages API and the library's ``images=`` must never run it, with a vision model or a text model, and the
400s must say what was wrong with the image and nothing of the server's internals."""

import base64
import os
import stat

from chatkit import ChatSession, GenerateParams
from chatkit.errors import InvalidMessageError
from chatkit.images import as_image
from chatkit.server import ServerConfig, start

import httpx
import pytest

PARAMS = GenerateParams(max_tokens=2, temperature=0.0)
EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
       b"newpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n")


@pytest.fixture
def fake_gs(tmp_path, monkeypatch):
    """A ``gs`` first on PATH that appends its arguments to a log: the log stays empty unless it ran."""
    bin_dir, log = tmp_path / "bin", tmp_path / "gs.log"
    bin_dir.mkdir()
    gs = bin_dir / "gs"
    gs.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexit 1\n')
    gs.chmod(gs.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def _url(data, media="image/png"):
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _bodies(data):
    url = _url(data)
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    responses = {"model": "m", "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": url}]}]}
    messages = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(data).decode()}}, {"type": "text", "text": "hi"}]}]}
    return {"/v1/chat/completions": chat, "/v1/responses": responses, "/v1/messages": messages}


def _message(r):
    body = r.json()
    return body["error"]["message"]


def _no_internals(text):
    for leak in ("0x", "BytesIO", "/tmp", "gs ", "Ghostscript", "Traceback"):
        assert leak not in text, text


def test_library_images_never_reach_ghostscript(fake_gs, tmp_path):
    path = tmp_path / "picture.png"
    path.write_bytes(EPS)
    for source in (EPS, _url(EPS), str(path), b"hello"):
        with pytest.raises(InvalidMessageError, match="not a PNG, JPEG, WebP or GIF") as caught:
            as_image(source)
        _no_internals(str(caught.value).replace(str(tmp_path), "PATH"))
    with pytest.raises(InvalidMessageError, match="PNG data is damaged"):
        as_image(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    assert not fake_gs.exists()


@pytest.mark.slow
def test_text_model_refuses_images_before_decoding(fake_gs, tiny):
    lm = tiny("qwen3", "bpe", 0)
    with pytest.raises(InvalidMessageError, match="reads no images"):
        ChatSession.builder(lm).generate_params(PARAMS.copy()).build().respond("hi", images=[EPS])
    with start(lm, ServerConfig(model_id="m", defaults=PARAMS)) as served:
        for route, body in _bodies(EPS).items():
            r = httpx.post(served.url.removesuffix("/v1") + route, json=body, timeout=60)
            assert r.status_code == 400, (route, r.text)
            assert "reads no images" in _message(r), (route, r.text)
    assert not fake_gs.exists()


@pytest.mark.slow
def test_vision_model_decodes_only_the_allowed_formats(fake_gs):
    pytest.importorskip("mlx_vlm")
    from chatkit.testing.vision import tiny_vision_model

    vlm = tiny_vision_model("qwen2_vl")
    with pytest.raises(InvalidMessageError, match="not a PNG"):
        ChatSession.builder(vlm).generate_params(PARAMS.copy()).build().respond("hi", images=[EPS])
    with start(vlm, ServerConfig(model_id="m", defaults=PARAMS)) as served:
        for data in (EPS, b"hello", b"GIF89a" + b"\0" * 20):
            for route, body in _bodies(data).items():
                r = httpx.post(served.url.removesuffix("/v1") + route, json=body, timeout=60)
                assert r.status_code == 400, (route, r.text)
                assert "Could not read" in _message(r), (route, r.text)
                _no_internals(_message(r))
    assert not fake_gs.exists()
