"""Tools from MCP servers (chatkit.MCPServer): real servers written with the mcp SDK
(tests/helpers/mcp_servers.py) over stdio and streamable HTTP on 127.0.0.1; the demo model's calculate
served over MCP in a full tool round; isError, a server that dies, one that hangs, one that does not
start; many tools; sessions sharing one server; saved conversations; ``chatkit chat --mcp``."""

import asyncio
import base64
import subprocess
import sys
import threading
import time
from pathlib import Path

import chatkit
from chatkit import ChatMessage, ChatSession, GenerateParams, InvalidParamsError, MCPServer, MCPServerError, Role
from chatkit.testing import Scripted
from chatkit.tools.mcp import mcp_servers, result_text

import pytest
from mcp.types import CallToolResult, ImageContent, TextContent
from test_tools import call

SERVERS = str(Path(__file__).parent / "helpers" / "mcp_servers.py")


def server(kind="calc"):
    return MCPServer(command=[sys.executable, SERVERS, kind])


def scripted(lm, replies, tools, **options):
    params = GenerateParams(max_tokens=80, logits_processors=[Scripted(lm.tokenizer, replies)])
    return ChatSession.builder(lm).tools(tools, **options).generate_params(params).build()


@pytest.fixture
def lm(tiny):
    return tiny(tokenizer="bpe-think")


@pytest.fixture(scope="module")
def calc():
    with server() as s:
        yield s


# -- fast: no server -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    ({}, "one of them"),
    ({"command": ["x"], "url": "http://127.0.0.1:1/mcp"}, "one of them"),
    ({"command": "python server.py"}, "list of strings"),
    ({"command": []}, "list of strings"),
    ({"url": "ftp://x"}, "http://"),
    ({"command": ["x"], "headers": {"a": "b"}}, "headers go with url"),
    ({"url": "http://h/mcp", "env": {"a": "b"}}, "env goes with command"),
    ({"command": ["x"], "env": {"a": 1}}, "dict of strings"),
])
def test_a_bad_server_spec_is_refused_before_anything_starts(kwargs, words):
    with pytest.raises(InvalidParamsError, match=words):
        MCPServer(**kwargs)


def test_a_result_becomes_text_structured_content_json_and_images_a_note():
    png = base64.b64encode(b"\x89PNG0123").decode()
    text = CallToolResult(content=[TextContent(type="text", text="a"), TextContent(type="text", text="b")],
                          structured_content={"ignored": True})
    assert result_text(text) == "a\n\nb"  # the text parts are the structured content's own rendering
    assert result_text(CallToolResult(content=[], structured_content={"x": [1, 2]})) == '{"x": [1, 2]}'
    image = result_text(CallToolResult(content=[ImageContent(type="image", data=png, mime_type="image/png")]))
    assert image == "[the tool returned an image (image/png, 8 bytes), which this chat cannot show the model]"


def test_a_saved_record_names_the_command_or_url_never_env_or_headers():
    stdio = MCPServer(command=["srv", "--x"], env={"TOKEN": "secret"})
    http = MCPServer(url="http://127.0.0.1:9/mcp", headers={"Authorization": "Bearer secret"})
    assert stdio.to_dict() == {"command": ["srv", "--x"]} and http.to_dict() == {"url": "http://127.0.0.1:9/mcp"}
    assert "secret" not in repr(stdio) + repr(http)
    assert MCPServer.from_dict(stdio.to_dict()).to_dict() == stdio.to_dict()
    with pytest.raises(InvalidParamsError):
        MCPServer.from_dict({"command": ["a"], "url": "http://x"})
    assert mcp_servers(None) == []


def test_a_server_whose_command_does_not_exist_is_a_clear_error_and_nothing_is_built(lm):
    missing = MCPServer(command=["/nonexistent/mcp-server"])
    with pytest.raises(MCPServerError, match="did not start: FileNotFoundError"):
        ChatSession.builder(lm).tools([missing])
    missing.close()


# -- real servers ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_demo_model_calls_calculate_over_mcp_as_it_calls_the_local_function(calc):
    demo = chatkit.load("demo")
    params = GenerateParams(max_tokens=48, temperature=0.0)
    over_mcp = ChatSession.builder(demo).tools([calc]).generate_params(params).build()
    assert [t["function"]["name"] for t in over_mcp.tools][:1] == ["calculate"]
    local = ChatSession.builder(demo).tools(chatkit.demo.tools()).generate_params(params).build()
    assert local.respond("What is 25 + 30?") == "25 + 30 = 55."
    assert over_mcp.respond("What is 25 + 30?") == "25 + 30 = 55."
    results = [m for m in over_mcp.history if m.role is Role.TOOL]
    assert [(m.name, m.content) for m in results] == [("calculate", "55")]
    assert [m.content for m in local.history if m.role is Role.TOOL] == ["55"]


@pytest.mark.slow
def test_is_error_is_the_tool_result_and_the_turn_goes_on(lm, calc):
    session = scripted(lm, [call("fail", reason="x"), "Sorry."], [calc])
    assert session.respond("Try.") == "Sorry."
    result = session.history[2]
    assert result.role is Role.TOOL and result.content.startswith("Error: fail: ")
    assert "failed on purpose: x" in result.content


@pytest.mark.slow
def test_images_and_structured_content_come_back_as_text(calc):
    assert calc.call_tool("data") == '{"x": 1, "y": [2, 3]}'
    assert calc.call_tool("both").startswith("see the picture\n\n[the tool returned an image (image/png, ")


@pytest.mark.slow
def test_a_tool_name_taken_twice_is_refused(lm, calc):
    with pytest.raises(InvalidParamsError, match="unique"):
        ChatSession.builder(lm).tools([chatkit.demo.calculate, calc])


@pytest.mark.slow
def test_a_server_that_dies_mid_conversation_is_a_tool_error_and_the_next_call_restarts_it(lm):
    with server() as dying:
        session = scripted(lm, [call("die"), "It died.", call("calculate", expression="6 * 7"), "42."], [dying])
        started = time.monotonic()
        assert session.respond("Die.") == "It died."
        assert time.monotonic() - started < 30
        died = session.history[2].content
        assert died.startswith("Error: die raised MCPServerError: The MCP server ") and "closed the connection" in died
        assert session.respond("Now multiply.") == "42."
        assert session.history[-2].content == "42"


@pytest.mark.slow
def test_a_hanging_tool_fails_within_the_tool_timeout_and_the_server_goes_on(lm, calc):
    session = scripted(lm, [call("hang"), "Too slow.", call("calculate", expression="1/4"), "0.25"], [calc], tool_timeout=1.5)
    started = time.monotonic()
    assert session.respond("Wait.") == "Too slow."
    assert time.monotonic() - started < 15
    assert session.history[2].content == "Error: hang did not return within 1.5 s and was cancelled."
    assert session.respond("Divide.") == "0.25" and session.history[-2].content == "0.25"


@pytest.mark.slow
def test_a_server_that_is_not_an_mcp_server_fails_to_start_and_the_builder_goes_on(lm):
    broken = server("broken")
    with pytest.raises(MCPServerError, match="did not start"):
        ChatSession.builder(lm).tools([broken], tool_timeout=20)
    broken.close()
    assert ChatSession.builder(lm).tools([chatkit.demo.calculate]).build().tools is not None


@pytest.mark.slow
def test_many_tools_join_the_sessions_tools_in_order(lm):
    with server("many") as many:
        session = scripted(lm, [call("echo_39", text="hi"), "Done."], [chatkit.demo.calculate, many])
        assert [t["function"]["name"] for t in session.tools] == ["calculate", *(f"echo_{i}" for i in range(40))]
        assert session.respond("Echo.") == "Done." and session.history[2].content == "39: hi"


@pytest.mark.slow
def test_sessions_and_forks_share_one_connection_concurrently(tiny, calc):
    lms = [tiny(tokenizer="bpe-think") for _ in range(3)]
    sessions = [scripted(m, [call("calculate", expression=f"{i} + 1"), f"{i + 1}."], [calc]) for i, m in enumerate(lms)]
    replies: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, sessions[i].respond("Add."))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert replies == {0: "1.", 1: "2.", 2: "3."}
    assert [s.history[2].content for s in sessions] == ["1", "2", "3"]
    ready = calc._ready
    fork = sessions[0].fork()
    assert fork.tools == sessions[0].tools and calc._ready is ready  # one connection, shared


@pytest.mark.slow
def test_an_async_session_and_manual_execution_use_the_server(lm, calc):
    session = scripted(lm, [call("calculate", expression="2 * 21"), "42."], [calc])
    assert asyncio.run(session.arespond("Multiply.")) == "42." and session.history[2].content == "42"
    manual = scripted(lm, [call("calculate", expression="10 / 4"), "2.5"], [calc], tool_execution="manual")
    manual.respond("Divide.")
    (pending,) = manual.pending_tool_calls
    result = calc.call_tool(pending.name, pending.arguments)
    assert result == "2.5"
    assert manual.respond(ChatMessage.tool(result, name=pending.name, tool_call_id=pending.id)) == "2.5"


@pytest.fixture(scope="module")
def http_url():
    process = subprocess.Popen([sys.executable, SERVERS, "calc", "http"], stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.slow
def test_a_streamable_http_server_serves_its_tools(lm, http_url):
    with MCPServer(url=http_url, headers={"X-Test": "1"}) as remote:
        session = scripted(lm, [call("calculate", expression="(3 + 4) * 6"), "42."], [remote])
        deadline = time.monotonic() + 30
        assert session.respond("Compute.") == "42." and session.history[2].content == "42"
        assert time.monotonic() < deadline


@pytest.mark.slow
def test_a_saved_conversation_records_its_servers_and_the_chat_reconnects_them(lm, calc, tmp_path):
    session = scripted(lm, [call("calculate", expression="1 + 1"), "2."], [calc])
    session.respond("Add.")
    path = tmp_path / "chat.safetensors"
    session.save_cache(path)
    assert chatkit.inspect_cache(path).mcp_servers == ({"command": [sys.executable, SERVERS, "calc"]},)
    from chatkit.cli.tools import mcp_servers as from_flags

    (again,) = from_flags([], resume=str(path))
    assert again.to_dict() == calc.to_dict()
    assert from_flags([f"{sys.executable} {SERVERS} calc"], resume=str(path))[0].to_dict() == calc.to_dict()


@pytest.mark.slow
def test_chat_mcp_flag_gives_the_session_the_servers_tools_and_tools_lists_them():
    import io

    from chatkit.cli import Repl, parser

    args = parser().parse_args(["chat", "--mcp", f"{sys.executable} {SERVERS} many", "--max-tokens", "8"])
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(args, out=out, err=err)
    try:
        repl.command("/tools")
        shown = out.getvalue()
        assert "calculate" in shown and "echo_39" in shown and f"[MCP {sys.executable} {SERVERS} many]" in shown
        assert [t["function"]["name"] for t in repl.session.tools][-1] == "echo_39"
    finally:
        for s in repl.servers:
            s.close()
