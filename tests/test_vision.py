"""Vision-language models (issue 34): tiny offline Qwen2-VL (M-RoPE, <|image_pad|>) and LLaVA (<image>,
plain RoPE) models through mlx-vlm; images in messages; the KV cache reused across turns, never across
different images; every bad image refused before anything changes."""

import base64
import io

from chatkit import ChatSession, GenerateParams
from chatkit.cache.ledger import Ledger
from chatkit.cache.planner import plan
from chatkit.errors import InvalidMessageError, InvalidParamsError
from chatkit.images import ImageSpan, as_image
from chatkit.messages import ChatMessage

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

GREEDY = GenerateParams(max_tokens=8, temperature=0.0)
ARCHS = ["qwen2_vl", "llava", "gemma3"]


def picture(seed, shape=(60, 70, 3)):
    return np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)


@pytest.fixture(scope="module")
def vlm():
    from chatkit.testing.vision import tiny_vision_model

    return tiny_vision_model


def session(lm, history=()):
    return ChatSession.builder(lm).generate_params(GREEDY).history(list(history)).build()


def reply_tokens(s, prompt, **options):
    with s.stream_respond(prompt, **options) as stream:
        for _ in stream:
            pass
    return list(stream.tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_turn_matches_mlx_vlm_generate(vlm, arch):
    """The same tokens as mlx-vlm's own generate_step over the processor's inputs for the same prompt."""
    from mlx_vlm.generate.ar import generate_step

    lm = vlm(arch)
    s = session(lm)
    image = picture(1)
    text = s.render(ChatMessage.user("What is in this picture?", images=[image]))
    ours = reply_tokens(s, "What is in this picture?", images=[image])
    processor = lm.vision.processor
    inputs = processor(text=[text], images=[as_image(image).pixels])
    ids, mask = mx.array(inputs["input_ids"]), mx.array(inputs["attention_mask"])
    if ids[0, 0].item() == lm.tokenizer.bos_token_id and text.startswith(lm.tokenizer.bos_token or "\0"):
        ids, mask = ids[:, 1:], mask[:, 1:]  # the template wrote the BOS already
    extra = {k: mx.array(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
    steps = generate_step(ids, lm.vision.vlm, mx.array(inputs["pixel_values"]), mask, max_tokens=len(ours),
                          temperature=0.0, **extra)
    theirs = [int(t) for t, _ in steps]
    assert ours == theirs
    assert ids.shape[1] == s.last_stats.prompt_tokens


def image_turn(lm, n):
    """A session that answered one message with picture ``n``, and where that image's tokens are."""
    s = session(lm)
    reply_tokens(s, "Describe it.", images=[picture(n)])
    (span,) = s._state.conversation.cache.ledger.images
    return s, span


@pytest.mark.parametrize("arch", ARCHS)
def test_turn_two_reuses_the_image_kv_and_encodes_once(vlm, arch):
    lm = vlm(arch)
    s, span = image_turn(lm, 2)
    assert s._state.images.encodings == 1
    second = reply_tokens(s, "Tell me more.")
    stats = s.last_stats
    assert stats.reused_tokens > span.end  # the image's tokens and everything up to the new message
    assert stats.prefilled_tokens < stats.prompt_tokens - span.end
    assert s._state.images.encodings == 1  # not encoded again
    fresh = session(lm, s.history[:-2])
    assert second == reply_tokens(fresh, "Tell me more.")  # the cache is only a saving


class Calls:
    """Counts the calls of what it wraps."""

    def __init__(self, wrapped):
        self.wrapped, self.count = wrapped, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.wrapped(*args, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_turn_two_does_no_image_work(vlm, arch, monkeypatch):
    """Turn 2 neither runs the processor, the vision tower nor the rope index (M-RoPE), and answers as a
    fresh session."""
    lm = vlm(arch)
    s, span = image_turn(lm, 5)
    language = lm.vision.text.language_model
    counted = [(lm.vision, "processor"), (lm.vision.vlm, "get_input_embeddings")]
    counted += [(language, "get_rope_index")] if lm.vision.mrope else []
    calls = []
    for owner, name in counted:
        calls.append(Calls(getattr(owner, name)))
        monkeypatch.setattr(owner, name, calls[-1])
    second = reply_tokens(s, "Tell me more.")
    assert [c.count for c in calls] == [0] * len(calls)
    assert s.last_stats.reused_tokens > span.end  # the image's KV reused
    assert second == reply_tokens(session(lm, s.history[:-2]), "Tell me more.")
    assert all(c.count > 0 for c in calls)  # the wrappers do count (the fresh session's turn)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_different_image_at_the_same_place_is_never_reused(vlm, arch):
    lm = vlm(arch)
    s, span = image_turn(lm, 3)
    s.undo()
    other = reply_tokens(s, "Describe it.", images=[picture(4)])  # same tokens, other pixels
    assert s.last_stats.reused_tokens <= span.start
    assert other == reply_tokens(session(lm), "Describe it.", images=[picture(4)])
    assert s._state.images.encodings == 2


def test_the_planner_stops_at_the_first_image_that_differs():
    tokens = (1, 2, 9, 9, 9, 3, 4)
    held = Ledger(tokens, 0, (ImageSpan(2, 5, "a"),))
    same = plan(held, tokens + (5,), trimmable=True, images=[ImageSpan(2, 5, "a")])
    assert same.keep == len(tokens)
    other = plan(held, tokens + (5,), trimmable=True, images=[ImageSpan(2, 5, "b")])
    assert other.keep == 2 and other.suffix == tokens[2:] + (5,)
    none = plan(held, tokens + (5,), trimmable=True)  # the same ids, but no image there now
    assert none.keep == 2


def test_content_parts_hugging_face_and_openai_shapes():
    image = picture(5)
    buffer = io.BytesIO()
    from PIL import Image as PILImage

    PILImage.fromarray(image).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    hf = ChatMessage.from_dict({"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]})
    openai = ChatMessage.from_dict({"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                {"type": "image_url", "image_url": {"url": url}}]})
    assert hf.content == openai.content == "hi"
    assert hf.images == openai.images  # the same pixels: the same image, whatever the wrapping
    assert as_image(buffer.getvalue()).digest == hf.images[0].digest


def test_bad_images_are_refused_before_anything_changes(vlm, tiny, monkeypatch):
    text = session(tiny("qwen3", "bpe", 0))
    with pytest.raises(InvalidMessageError, match="reads no images"):
        text.respond("What is this?", images=[picture(6)])
    assert text.history == [] and text._state.conversation.cache.empty
    s = session(vlm("qwen2_vl"))
    with pytest.raises(InvalidMessageError, match="Could not read"):
        s.respond("What is this?", images=[b"not an image"])
    with pytest.raises(InvalidMessageError, match="No image file"):
        s.respond("What is this?", images=["/nonexistent/picture.png"])
    with pytest.raises(InvalidMessageError, match="uint8"):
        s.respond("What is this?", images=[np.zeros((4, 4, 3), dtype=np.float32)])
    with pytest.raises(InvalidParamsError, match="list of images"):
        s.respond("What is this?", images=picture(7))
    monkeypatch.setattr("chatkit.images.MAX_IMAGE_PIXELS", 100)
    with pytest.raises(InvalidMessageError, match="scale it down"):
        s.respond("What is this?", images=[picture(8)])
    monkeypatch.setattr(s._state.images.vision, "max_images", 1)
    with pytest.raises(InvalidMessageError, match="more than this model takes"):
        s.respond("What is this?", images=[picture(9, (8, 8, 3)), picture(10, (8, 8, 3))])
    assert s.history == [] and s._state.conversation.cache.empty and s._state.images.encodings == 0


@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3"])  # gemma3: sliding-window (rotating) cache layers too
def test_save_and_restore_continue_without_re_encoding(vlm, tmp_path, arch):
    lm = vlm(arch)
    s = session(lm)
    reply_tokens(s, "Describe it.", images=[picture(11)])
    s.save_cache(tmp_path / "chat.safetensors")
    live = reply_tokens(s.fork(), "Tell me more.")
    restored = ChatSession.builder(lm).cache(tmp_path / "chat.safetensors").build()
    assert restored.history[0].images[0].pixels is None  # known by its hash: no pixels in the file
    (span,) = restored._state.conversation.cache.ledger.images
    assert reply_tokens(restored, "Tell me more.") == live
    assert restored.last_stats.reused_tokens > span.end and restored._state.images.encodings == 0


def test_a_restored_turn_that_needs_missing_pixels_is_a_cache_error(vlm, tmp_path):
    from chatkit.errors import CacheError

    lm = vlm("qwen2_vl")
    s = session(lm)
    reply_tokens(s, "Describe it.", images=[picture(12)])
    s.save_cache(tmp_path / "hashes.safetensors")
    s.save_cache(tmp_path / "pixels.safetensors", images=True)
    restored = ChatSession.builder(lm).cache(tmp_path / "hashes.safetensors").build()
    restored.release_cache()  # the next turn must prefill the image again
    history = restored.history
    with pytest.raises(CacheError, match="images=True"):
        restored.respond("Tell me more.")
    assert restored.history == history
    with_pixels = ChatSession.builder(lm).cache(tmp_path / "pixels.safetensors").build()
    with_pixels.release_cache()
    expected = reply_tokens(session(lm, s.history), "Tell me more.")
    assert reply_tokens(with_pixels, "Tell me more.") == expected
    assert with_pixels._state.images.encodings == 1


def test_chat_image_command_attaches_to_the_next_message(vlm, tmp_path, monkeypatch):
    import io as _io

    from chatkit.cli import parser
    from chatkit.cli.repl import Repl

    from PIL import Image as PILImage

    lm = vlm("qwen2_vl")
    path = tmp_path / "picture.png"
    PILImage.fromarray(picture(13)).save(path)
    monkeypatch.setattr("chatkit.cli.repl.load_model", lambda *a, **k: lm)
    out = _io.StringIO()
    repl = Repl(parser().parse_args(["chat", "--model", str(tmp_path), "--max-tokens", "4"]),
                out=out, err=out)
    lines = iter([f"/image {path}", "What is this?", "/image /nowhere.png", "And now?"])

    def read(*_):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    repl.run(read=read)
    first, second = repl.session.history[0], repl.session.history[2]
    assert first.images[0].digest == as_image(path).digest and second.images == ()
    assert "attached" in out.getvalue() and "No image file" in out.getvalue()


@pytest.mark.parametrize("arch", ARCHS)
def test_several_images_over_turns_answer_as_a_fresh_session(vlm, arch):
    lm = vlm(arch)
    s = session(lm)
    reply_tokens(s, "Compare these.", images=[picture(14), picture(15, (30, 90, 3))])
    third = reply_tokens(s, "And this one?", images=[picture(16)])
    assert [span.digest for span in s._state.conversation.cache.ledger.images] == [
        as_image(picture(n, shape)).digest for n, shape in ((14, (60, 70, 3)), (15, (30, 90, 3)), (16, (60, 70, 3)))]
    assert s.last_stats.reused_tokens > s._state.conversation.cache.ledger.images[1].end
    assert third == reply_tokens(session(lm, s.history[:-2]), "And this one?", images=[picture(16)])


def test_bigger_text_towers_for_benchmarks(vlm):
    """chatkit.testing builds the same Qwen2-VL with a wider language model (M-RoPE sections scaled to its
    heads) that answers turn 2 as a fresh session; sizes that cannot make a model are refused."""
    from chatkit.testing.vision import tiny_vision_model_path

    lm = vlm("qwen2_vl", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert lm.config["hidden_size"] == 128 and lm.config["rope_scaling"]["mrope_section"] == [4, 6, 6]
    s, _ = image_turn(lm, 6)
    second = reply_tokens(s, "Tell me more.")
    assert second == reply_tokens(session(lm, s.history[:-2]), "Tell me more.")
    for bad in ({"hidden_size": 100}, {"num_key_value_heads": 3}, {"vocab_size": 10}, {"num_hidden_layers": 0}):
        with pytest.raises(InvalidParamsError):
            tiny_vision_model_path("qwen2_vl", **bad)


def test_gemma3_keeps_its_sliding_window_layers_as_mlx_lm_caches(vlm):
    """Gemma 3's language model makes mlx-vlm cache layers: the session keeps mlx-lm's of the same shape; a
    kind of layer chatkit cannot keep is refused (at load)."""
    from chatkit.errors import ModelLoadError
    from chatkit.model.vision import _lm_caches

    from mlx_lm.models.cache import KVCache, RotatingKVCache

    lm = vlm("gemma3")
    s, _ = image_turn(lm, 7)
    assert [type(c) for c in s._state.conversation.cache.layers] == [RotatingKVCache, KVCache]
    ArraysCache = type("ArraysCache", (), {})
    with pytest.raises(ModelLoadError, match="mlx-vlm directly"):
        _lm_caches([ArraysCache()])


def test_mrope_positions_continue_after_the_prompt():
    from chatkit.model.vision import Positions

    ids = mx.array([[[0, 1, 2, 2, 3]] * 1] * 3)
    positions = Positions(ids, delta=-1)  # 5 tokens whose last position is 3
    assert positions.at(1, 2).tolist() == [[[1, 2]]] * 3
    assert positions.at(5, 1).tolist() == [[[4]]] * 3
    assert positions.at(4, 3).tolist() == [[[3, 4, 5]]] * 3
    later = Positions(ids + 10, delta=-1, start=10)  # the same 5 tokens at indexes 10..14
    assert later.at(13, 3).tolist() == [[[12, 13, 14]]] * 3
    assert Positions(None, delta=-1, start=5).at(7, 2).tolist() == [[[6, 7]]] * 3  # text only from 5 on


def test_mrope_positions_from_any_start_equal_the_whole_prompts(vlm):
    """A turn computes positions only after the last image before its new tokens: from any start, with the
    delta remembered or not, the same ids as the model's rope index over the whole prompt."""
    from chatkit.model.vision import ImageTable, Positions
    from chatkit.text.images import locate

    lm = vlm("qwen2_vl")
    prompting = session(lm)._turns.prompting()
    messages = [ChatMessage.user("Compare.", images=[picture(20), picture(21, (30, 90, 3))]),
                ChatMessage.assistant("Two of them."), ChatMessage.user("And this?", images=[picture(22, (90, 40, 3))])]
    table = prompting.vision
    prompt = prompting.ids(messages, GREEDY)
    spans = locate(prompt, prompting.images(messages), table.placeholder, table.ids, table.layout)
    assert len({s.layout for s in spans}) == 3  # three grids
    whole = Positions(*lm.vision.rope_index(prompt, spans))
    warm = ImageTable(lm.vision)
    warm.positions(prompt, spans, 0)  # remembers the delta after the last image
    for start in range(len(prompt)):
        expected = whole.at(start, len(prompt) + 3 - start).tolist()
        for t in (ImageTable(lm.vision), warm):
            assert t.positions(prompt, spans, start).at(start, len(prompt) + 3 - start).tolist() == expected, start
