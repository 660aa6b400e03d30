"""The command line refuses bad flags with one ``error:`` line and exit status 2, before it loads a
model, and never serves the network without a key unless told to (issue 33, items 14 and 16); the
REPL works in a terminal that never answers cursor position requests (also noticed)."""

import io
import os
import subprocess
import sys

from chatkit.cli import main

import pexpect
import pytest


@pytest.fixture
def never_serves(monkeypatch):
    """``chatkit serve``'s loading and serving replaced: what they were called with, and nothing runs."""
    calls = []
    monkeypatch.setattr("chatkit.cli.serve.load_model", lambda name: calls.append(("load", name)) or object())
    monkeypatch.setattr("chatkit.cli.serve.serve", lambda lm, config, **kw: calls.append(("serve", config, kw)))
    monkeypatch.setattr("logging.basicConfig", lambda **kw: None)  # the test process's logging stays as it is
    return calls


def one_error_line(err):
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("usage:")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("flags, says", [
    (["--port", "-1"], "--port"),
    (["--port", "99999"], "--port"),
    (["--port", "http"], "--port"),
    (["--log-level", "nonsense"], "--log-level"),
    (["--store", "{file}"], "--store"),
    (["--store", "{file}/store"], "--store"),
    (["--store", "{store}"], "--store"),  # holding a file where the store keeps its responses folder
    (["--host", "0.0.0.0"], "--allow-unauthenticated"),
    (["--host", "::"], "--allow-unauthenticated"),
    (["--host", "192.168.1.20"], "--api-key"),
    (["--host", "example.com"], "--api-key"),
    (["--api-key", ""], "--api-key"),
    (["--batch", "-1"], "--batch"),
    (["--batch", "4", "--parallel", "8"], "--parallel"),
    (["--num-draft", "many"], "--num-draft"),
    (["--max-conversations", "0"], "--max-conversations"),
])
def test_bad_serve_flags_are_one_error_line_and_exit_2(never_serves, capsys, tmp_path, flags, says):
    file = tmp_path / "a-file"
    file.write_text("")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "responses").write_text("")
    flags = [f.format(file=file, store=tmp_path / "store") for f in flags]
    assert main(["serve", *flags]) == 2
    assert says in one_error_line(capsys.readouterr().err)
    assert never_serves == []  # refused before a model loads


@pytest.mark.parametrize("flags, host", [
    ([], "127.0.0.1"),
    (["--host", "localhost"], "localhost"),
    (["--host", "127.0.0.2"], "127.0.0.2"),
    (["--host", "::1"], "::1"),
    (["--host", "0.0.0.0", "--api-key", "sesame"], "0.0.0.0"),
    (["--host", "0.0.0.0", "--allow-unauthenticated"], "0.0.0.0"),
    (["--log-level", "WARNING", "--port", "1"], "127.0.0.1"),
])
def test_good_serve_flags_serve(never_serves, capsys, flags, host):
    assert main(["serve", *flags]) == 0
    (_, config, kw) = never_serves[-1]
    assert kw["host"] == host


@pytest.mark.slow
def test_the_serve_command_exits_2_without_a_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for flags in (["--port", "-1"], ["--host", "0.0.0.0"], ["--log-level", "nonsense"]):
        out = subprocess.run([sys.executable, "-m", "chatkit", "serve", *flags], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 2, out.stderr
        one_error_line(out.stderr)


# -- the REPL in a terminal that never answers cursor position requests (CPR) ----------------------
PROMPT = "\x1b[?2004h"  # prompt_toolkit turns bracketed paste on as it starts reading a line


@pytest.mark.slow  # a subprocess
def test_the_repl_never_waits_for_cursor_position_reports(tmp_path):
    """pexpect's terminal never answers ``ESC [6n``: prompt_toolkit waited a second for the answer after
    each line (a line typed meanwhile was held), then printed a warning. The REPL does not ask."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TERM": "xterm",
           "CHATKIT_HISTORY_FILE": str(tmp_path / "history")}
    env.pop("PROMPT_TOOLKIT_NO_CPR", None)  # the terminal as it is, nobody answering
    child = pexpect.spawn(sys.executable, ["-m", "chatkit", "chat"], env=env, encoding="utf-8", timeout=120,
                          dimensions=(40, 200))
    child.logfile_read = seen = io.StringIO()
    try:
        child.expect_exact(PROMPT)
        child.sendline("My name is Ada.")
        child.expect_exact("Nice to meet you, Ada.")
        child.expect_exact(PROMPT)
        child.sendline("/quit")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    out = seen.getvalue()
    assert "\x1b[6n" not in out and "cursor position" not in out, out


@pytest.fixture(scope="module")
def model_dir():
    from chatkit.testing import tiny_model_path

    return str(tiny_model_path(arch="qwen3", tokenizer="bpe"))


@pytest.mark.slow  # a subprocess
def test_a_line_typed_with_enter_during_a_reply_is_read_at_the_next_prompt(model_dir, tmp_path):
    """Typed ahead while a reply streams, ``/stats`` and Enter: the next prompt takes the line as it
    was typed (before, the Enter was lost and the line waited at the prompt)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TERM": "xterm",
           "CHATKIT_HISTORY_FILE": str(tmp_path / "history")}
    child = pexpect.spawn(sys.executable, ["-m", "chatkit", "chat", "--model", model_dir, "--max-tokens", "3000"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    try:
        child.expect_exact(PROMPT)
        child.sendline("Tell me a long story")
        child.expect_exact("\x1b[?2004l")  # the line was read: the reply is being generated
        child.expect(r"\w")  # and streams
        child.send("/stats\r")
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact("finish: cancelled", timeout=30)  # /stats ran without another key
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
