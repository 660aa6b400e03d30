"""Images in tool results (issue 49): an MCP tool's image is an image part of the tool message when the
session's model is a vision-language model (decoded through the user images' allow-list; a bad one is a
note), a note otherwise; the image tool message survives history, save/restore, fork and undo, and the next
turn reuses its KV as a fresh session would compute it. A template that cannot place an image in a tool
message gets it in a user message after the results."""

import sys
from pathlib import Path

from chatkit import ChatMessage, ChatSession, GenerateParams, Role
from chatkit.errors import InvalidMessageError, InvalidParamsError
from chatkit.images import as_image
from chatkit.messages import ToolCall, saved_dict
from chatkit.testing import Scripted
from chatkit.text.capabilities import Capabilities, adapt, probe
from chatkit.tools import MCPServer, Tool, ToolOutput, as_tool, call_tool

import numpy as np
import pytest
from test_tools import call

pytest.importorskip("mlx_vlm")
pytest.importorskip("mcp")

from helpers.mcp_servers import picture_png  # noqa: E402  (needs the mcp SDK)

SERVERS = str(Path(__file__).parent / "helpers" / "mcp_servers.py")
GREEDY = GenerateParams(max_tokens=30, temperature=0.0)
PNG = picture_png()


@pytest.fixture(scope="module")
def vlm():
    from chatkit.testing.vision import tiny_vision_model

    return tiny_vision_model("qwen2_vl_tools")


@pytest.fixture(scope="module")
def calc():
    with MCPServer(command=[sys.executable, SERVERS, "calc"]) as server:
        yield server


def scripted(lm, replies, tools):
    params = GenerateParams(max_tokens=30, temperature=0.0, logits_processors=[Scripted(lm.tokenizer, replies)])
    return ChatSession.builder(lm).tools(tools).generate_params(params).build()


def reply_tokens(session, prompt):
    with session.stream_respond(prompt) as stream:
        for _ in stream:
            pass
    return list(stream.tokens)


def image_tokens(session, span):
    return session._state.conversation.cache.ledger.tokens[span.start : span.end]


# -- fast: no server ---------------------------------------------------------------------------------
def test_a_tool_output_shows_good_images_to_a_vision_model_and_notes_the_rest():
    output = ToolOutput("a picture", ((PNG, "image/png"), (b"%!PS-Adobe", "image/png")))
    shown, text = output.read(images=True)
    assert [i.digest for i in shown] == [as_image(PNG).digest] and (shown[0].width, shown[0].height) == (50, 40)
    assert text.startswith("a picture\n\n[the tool returned an image (image/png, 10 bytes) that could not be shown: ")
    assert "not a PNG, JPEG, WebP or GIF" in text  # the user images' allow-list: no other decoder runs
    shown, text = output.read(images=False)
    assert shown == () and text == (f"a picture\n\n[the tool returned an image (image/png, {len(PNG)} bytes), which this "
                                    "chat cannot show the model]\n\n[the tool returned an image (image/png, 10 bytes), "
                                    "which this chat cannot show the model]")


@pytest.mark.parametrize("bad", [(1, ()), ("t", ((PNG,),)), ("t", (("path.png", "image/png"),)), ("t", "image")])
def test_a_bad_tool_output_is_refused(bad):
    with pytest.raises(InvalidParamsError, match="pairs"):
        ToolOutput(*bad)


def test_call_tool_makes_the_tool_message_from_the_output_and_plain_strings_still_work():
    async def snap() -> ToolOutput:
        return ToolOutput("", ((PNG, "image/png"),))

    def plain() -> str:
        return "text"

    tools = [Tool(as_tool({"name": "snap"}).schema, snap), Tool(as_tool({"name": "plain"}).schema, plain)]
    shown = call_tool(tools, ToolCall("a1b2c3d4e", "snap"), images=True)
    assert shown.role is Role.TOOL and shown.content == "" and shown.images[0].digest == as_image(PNG).digest
    noted = call_tool(tools, ToolCall("a1b2c3d4e", "snap"))
    assert noted.images == () and noted.content.startswith("[the tool returned an image (image/png, ")
    assert call_tool(tools, ToolCall("a1b2c3d4e", "plain"), images=True) == ChatMessage.tool("text", "plain", "a1b2c3d4e")


def test_only_user_and_tool_messages_show_images():
    message = ChatMessage.tool("r", "snap", "a1b2c3d4e", images=[PNG])
    assert ChatMessage.from_dict(message.to_dict()).images[0].pixels is None  # by its hash, as a user image
    assert ChatMessage.from_dict(saved_dict(message, pixels=True)) == message
    with pytest.raises(InvalidMessageError, match="Only a user message or a tool result"):
        ChatMessage(Role.ASSISTANT, "a", images=(PNG,))


def test_the_probe_tells_templates_that_place_tool_images_from_those_that_cannot():
    from chatkit.testing.templates import CHATML
    from chatkit.testing.vision import GEMMA3_TEMPLATE, LLAVA_TEMPLATE, QWEN2_VL_TEMPLATE, QWEN_VL_TOOLS_TEMPLATE

    from transformers.utils.chat_template_utils import _compile_jinja_template

    def render(template):
        compiled = _compile_jinja_template(template)
        return lambda messages, tools: compiled.render(messages=messages, tools=tools, bos_token="<s>", eos_token="</s>")

    places = {name: probe(render(t)).tool_images for name, t in [
        ("qwen2_vl", QWEN2_VL_TEMPLATE), ("qwen_tools", QWEN_VL_TOOLS_TEMPLATE), ("llava", LLAVA_TEMPLATE),
        ("gemma3", GEMMA3_TEMPLATE), ("chatml", CHATML)]}
    assert places == {"qwen2_vl": True, "qwen_tools": True, "llava": True, "gemma3": False, "chatml": False}


def test_images_a_template_cannot_place_in_tool_messages_move_to_the_next_user_message_in_order():
    image = {"type": "image"}
    results = [{"role": "user", "content": [image, {"type": "text", "text": "q"}]}, {"role": "assistant", "content": "c"},
               {"role": "tool", "content": [image, {"type": "text", "text": "r1"}]},
               {"role": "tool", "content": [{"type": "image", "n": 2}, {"type": "text", "text": "r2"}]}]
    cannot = Capabilities(tool_images=False)
    out = adapt(results, cannot)
    assert out[2:] == [{"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
                       {"role": "user", "content": [image, {"type": "image", "n": 2}, {"type": "text", "text": ""}]}]
    out = adapt([*results, {"role": "user", "content": [{"type": "image", "n": 3}, {"type": "text", "text": "next"}]}], cannot)
    assert out[-1] == {"role": "user", "content": [image, {"type": "image", "n": 2}, {"type": "image", "n": 3},
                                                   {"type": "text", "text": "next"}]}
    no_tool_role = adapt([*results, {"role": "user", "content": "next"}], Capabilities(tool_role=False, tool_images=False))
    assert [m["role"] for m in no_tool_role] == ["user", "assistant", "user"]  # roles still alternate
    assert [p for p in no_tool_role[-1]["content"] if p["type"] == "image"] == [image, {"type": "image", "n": 2}]
    assert adapt(results, Capabilities()) == results  # a template that places them keeps them


@pytest.mark.filterwarnings("ignore:This chat template has no tool role")
def test_a_vision_template_without_a_tool_role_shows_the_tool_image_in_a_user_message():
    from chatkit.testing.vision import tiny_vision_model

    lm = tiny_vision_model("gemma3")
    history = [ChatMessage.user("Look."), ChatMessage.assistant("", tool_calls=[ToolCall("a1b2c3d4e", "snap")]),
               ChatMessage.tool("a picture", "snap", "a1b2c3d4e", images=[PNG])]
    s = ChatSession.builder(lm).generate_params(GREEDY).history(history).build()
    tokens = reply_tokens(s, "And?")
    (span,) = s._state.conversation.cache.ledger.images
    assert span.digest == as_image(PNG).digest and s._state.images.encodings == 1
    assert set(image_tokens(s, span)) == {lm.vision.image_token_id}
    assert len(tokens) > 0


def test_the_prompt_cache_keys_a_tool_images_blocks_by_its_pixels(vlm):
    from chatkit.cache.prompt import PromptCache

    other_png = as_image(np.random.default_rng(8).integers(0, 255, (40, 50, 3), dtype=np.uint8))
    pc = PromptCache(block_tokens=8)

    def session(image, cache):
        history = [ChatMessage.user("Take a picture of the garden, please, and tell me about its colours."),
                   ChatMessage.assistant("", tool_calls=[ToolCall("a1b2c3d4e", "picture")]),
                   ChatMessage.tool("a picture of the garden", "picture", "a1b2c3d4e", images=[image])]
        return ChatSession.builder(vlm).generate_params(GREEDY).prompt_cache(cache).history(history).build()

    first = session(PNG, pc)
    reply_tokens(first, "Describe it.")
    (span,) = first._state.conversation.cache.ledger.images
    other = session(other_png, pc)  # the same tokens, other pixels
    assert reply_tokens(other, "Describe it.") == reply_tokens(session(other_png, None), "Describe it.")
    assert other.last_stats.reused_tokens <= span.start
    same = session(PNG, pc)
    assert reply_tokens(same, "Describe it.") == reply_tokens(session(PNG, None), "Describe it.")
    assert same.last_stats.reused_tokens > span.end  # the tool image's KV and the text after it


# -- real MCP servers --------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_mcp_image_is_an_image_part_of_the_tool_message_and_the_model_sees_it(vlm, calc):
    s = scripted(vlm, [call("picture"), "Done."], [calc])
    assert s.respond("Take a picture.") == "Done."
    result = s.history[2]
    assert result.role is Role.TOOL and result.name == "picture" and result.content == "a picture"
    assert [i.digest for i in result.images] == [as_image(PNG).digest]
    (span,) = s._state.conversation.cache.ledger.images  # the processor made the image's tokens, the tower its features
    assert span.digest == as_image(PNG).digest and s._state.images.encodings == 1
    assert set(image_tokens(s, span)) == {vlm.vision.image_token_id} and span.end - span.start == 6
    assert "<|vision_start|><|image_pad|><|vision_end|>a picture\n</tool_response>" in s.render("x")


@pytest.mark.slow
def test_a_bad_image_from_the_server_is_a_note_and_the_turn_goes_on(vlm, calc):
    s = scripted(vlm, [call("bad_image"), "Sorry."], [calc])
    assert s.respond("Take a picture.") == "Sorry."
    result = s.history[2]
    assert result.images == () and result.content.count("that could not be shown") == 2
    assert s._state.conversation.cache.ledger.images == ()


@pytest.mark.slow
def test_the_next_turn_reuses_the_image_kv_and_answers_as_a_fresh_session(vlm, calc, tmp_path):
    s = scripted(vlm, [call("picture"), "Done."], [calc])
    s.respond("Take a picture.")
    (span,) = s._state.conversation.cache.ledger.images
    s.save_cache(tmp_path / "chat.safetensors", images=True)
    forked = s.fork()
    live = reply_tokens(s, "Tell me more.")
    assert s.last_stats.reused_tokens > span.end and s._state.images.encodings == 1  # not prefilled nor encoded again
    fresh = ChatSession.builder(vlm).tools([calc]).generate_params(GREEDY).history(s.history[:-2]).build()
    assert reply_tokens(fresh, "Tell me more.") == live
    assert reply_tokens(forked, "Tell me more.") == live and forked.history[2].images == s.history[2].images
    restored = ChatSession.builder(vlm).tools([calc]).generate_params(GREEDY).cache(tmp_path / "chat.safetensors").build()
    assert restored.history[2].images[0].digest == span.digest and restored.history[2].images[0].pixels is not None
    assert reply_tokens(restored, "Tell me more.") == live
    assert restored.last_stats.reused_tokens > span.end
    with restored.stream_regenerate() as stream:
        for _ in stream:
            pass
    assert list(stream.tokens) == live and restored.history[2].images[0].digest == span.digest
    restored.undo()
    assert restored.history[2].images[0].digest == span.digest  # undo takes the last exchange only
    assert reply_tokens(restored, "Tell me more.") == live


@pytest.mark.slow
def test_a_text_model_still_gets_the_note(tiny, calc):
    lm = tiny(tokenizer="bpe-think")
    s = scripted(lm, [call("picture"), "Done."], [calc])
    assert s.respond("Take a picture.") == "Done."
    result = s.history[2]
    assert result.images == ()
    assert result.content == f"a picture\n\n[the tool returned an image (image/png, {len(PNG)} bytes), which this chat cannot show the model]"
