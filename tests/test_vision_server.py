"""chatkit serve with a vision-language model (issue 34): chat completions' image_url parts, responses'
input_image parts and the Anthropic API's base64 image blocks; replies equal an in-process session's;
images sent to a text model, or as URLs, are 400s."""

import base64
import io

from chatkit import ChatSession, GenerateParams
from chatkit.images import as_image
from chatkit.server import ServerConfig, start

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

PARAMS = GenerateParams(max_tokens=6, temperature=0.0)


def png(seed):
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(seed):
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


@pytest.fixture(scope="module")
def vlm():
    from chatkit.testing.vision import tiny_vision_model

    return tiny_vision_model("qwen2_vl")


@pytest.fixture(scope="module")
def served(vlm):
    with start(vlm, ServerConfig(model_id="vlm", defaults=PARAMS)) as running:
        yield running


def expected(vlm, seed, text="What is this?"):
    return ChatSession.builder(vlm).generate_params(PARAMS.copy()).build().respond(text, images=[png(seed)])


def test_chat_completions_image_url_parts(served, vlm):
    body = {"model": "vlm", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url(1)}}]}]}
    r = httpx.post(f"{served.url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected(vlm, 1)
    again = httpx.post(f"{served.url}/chat/completions", json={**body, "messages": [
        *body["messages"], r.json()["choices"][0]["message"], {"role": "user", "content": "More?"}]}, timeout=120)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the image's KV reused


def test_responses_input_image_and_anthropic_image_blocks(served, vlm):
    r = httpx.post(f"{served.url}/responses", json={"model": "vlm", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": data_url(2)}]}]},
        timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == expected(vlm, 2)
    items = httpx.get(f"{served.url}/responses/{r.json()['id']}/input_items", timeout=30).json()["data"]
    image, text = items[0]["content"]  # listed as OpenAI lists them: the image's pixels, then the text
    assert image["type"] == "input_image" and text == {"type": "input_text", "text": "What is this?"}
    assert as_image(image["image_url"]).digest == as_image(png(2)).digest
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(3)).decode()}
    m = httpx.post(f"{served.url}/messages", json={"model": "vlm", "max_tokens": 6, "messages": [{"role": "user",
        "content": [{"type": "image", "source": source}, {"type": "text", "text": "What is this?"}]}]}, timeout=120)
    assert m.status_code == 200, m.text
    assert m.json()["content"][0]["text"] == expected(vlm, 3)


def test_bad_images_are_400s(served, tiny):
    url = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    r = httpx.post(f"{served.url}/chat/completions", json={"model": "vlm", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, url]}]}, timeout=60)
    assert r.status_code == 400 and "data URL" in r.json()["error"]["message"]
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
    r = httpx.post(f"{served.url}/chat/completions", json={"model": "vlm", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, broken]}]}, timeout=60)
    assert r.status_code == 400 and "Could not read" in r.json()["error"]["message"]
    with start(tiny("qwen3", "bpe", 0), ServerConfig(defaults=PARAMS)) as text_only:
        r = httpx.post(f"{text_only.url}/chat/completions", json={"model": "x", "messages": [{"role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(4)}}]}]},
            timeout=60)
    assert r.status_code == 400 and "reads no images" in r.json()["error"]["message"]
