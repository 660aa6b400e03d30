"""The chatkit command for real: a REPL in a pseudo-terminal, Ctrl-C mid-reply, save/undo/load."""

import os
import subprocess
import sys

import pexpect
import pytest

from chatkit.testing import tiny_model_path


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_path(arch="qwen3", tokenizer="bpe"))


def spawn(*args, timeout=180):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "chatkit", *args], env=env, encoding="utf-8", timeout=timeout)
    child.expect("Ctrl-D to quit")
    return child


def prompt(child):
    child.expect_exact("> ")


def interrupted_reply(child, text):
    child.sendline(text)
    child.expect_exact(text + "\r\n")  # the terminal's echo of the line
    child.expect(r"\S")  # the reply has started streaming
    child.sendintr()
    child.expect_exact("[stopped]")
    prompt(child)


def test_repl_conversation_with_ctrl_c_save_undo_and_load(model_dir, tmp_path):
    saved, after_undo = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    child = spawn("chat", "--model", model_dir, "--max-tokens", "3000")
    prompt(child)
    interrupted_reply(child, "Tell me a long story")
    child.sendline("/stats")
    child.expect("finish: cancelled")
    prompt(child)
    child.sendline(f"/save {saved}")
    child.expect(r"saved \d+ tokens, 2 messages")
    prompt(child)
    interrupted_reply(child, "Another one")
    child.sendline("/undo")
    child.expect_exact("undone: 'Another one'")
    prompt(child)
    child.sendline("/load /no/such/file.safetensors")
    child.expect("error: No cache file")  # one line, no traceback, and the session goes on
    prompt(child)
    child.sendline(f"/save {after_undo}")
    child.expect(r"saved \d+ tokens, 2 messages")
    prompt(child)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    assert "Traceback" not in child.before

    again = spawn("chat", "--model", model_dir, "--max-tokens", "3000")
    prompt(again)
    again.sendline(f"/load {after_undo}")
    again.expect(r"loaded .*: 2 messages, \d+ tokens cached")
    prompt(again)
    interrupted_reply(again, "Go on")
    again.sendline("/stats")
    again.expect(r"prompt \d+ tokens \((\d+) reused")
    assert int(again.match.group(1)) > 0, "the loaded cache was reused"
    prompt(again)
    again.sendeof()
    again.expect(pexpect.EOF)

    out = subprocess.run([sys.executable, "-m", "chatkit", "inspect", str(after_undo)], capture_output=True, text=True)
    assert out.returncode == 0 and "turns: 1, messages: 2" in out.stdout and "Tell me a long story" in out.stdout


def test_commands_without_a_terminal_and_errors(model_dir, tmp_path):
    script = "\n".join(["Hello", "/retry", "/system Be brief.", "/clear", "/undo", "/help", "/nope", "/quit"]) + "\n"
    out = subprocess.run(
        [sys.executable, "-m", "chatkit", "--model", model_dir, "--max-tokens", "5"],
        input=script, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "system prompt set" in out.stdout and "cleared" in out.stdout and "/retry" in out.stdout
    assert "error: There is no exchange to undo" in out.stderr and "Traceback" not in out.stderr
    bad = subprocess.run([sys.executable, "-m", "chatkit", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr


def test_chat_shows_reasoning_dimmed_or_hidden_and_tool_calls_and_results(tmp_path, monkeypatch):
    import io

    from chatkit import GenerateParams
    from chatkit.cli import Repl, parser
    from chatkit.testing import Scripted

    (tmp_path / "weather_tools.py").write_text(
        'def get_weather(city: str) -> str:\n    """The weather.\n\n    Args:\n        city: The city.\n    """\n'
        '    return f"sunny in {city}"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = str(tiny_model_path(arch="qwen3", tokenizer="bpe-think"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for flags, shows_reasoning in [((), True), (("--hide-thinking",), False)]:
        out = io.StringIO()
        args = parser().parse_args(["chat", "--model", folder, "--tools", "weather_tools:get_weather", *flags])
        repl = Repl(args, out=out, err=io.StringIO())
        script = Scripted(repl.lm.tokenizer, [f"<think>\nCheck Oslo.\n</think>\n\n{call}", "It is sunny."])
        repl.session.generate_params = GenerateParams(max_tokens=60, logits_processors=[script])
        repl.reply(lambda repl=repl: repl.session.stream_respond("Weather in Oslo?"))
        shown = out.getvalue()
        assert ("Check Oslo." in shown) is shows_reasoning and "<think>" not in shown and "<tool_call>" not in shown
        assert '[tool call] get_weather({"city": "Oslo"})' in shown and "[tool result] sunny in Oslo" in shown
        assert shown.rstrip().endswith("It is sunny.")


def test_tools_flag_names_what_cannot_be_imported():
    from chatkit import InvalidParamsError
    from chatkit.cli import _import_function

    with pytest.raises(InvalidParamsError, match="module:function"):
        _import_function("no_such_module_here:f")
