"""The chatkit command for real: a REPL in a pseudo-terminal (prompt_toolkit), Ctrl-C mid-reply,
save/undo/load, line editing and history; piped input; flags, errors and inspect."""

import contextlib
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from chatkit.cli import main
from chatkit.testing import tiny_model_path

import pexpect
import pytest

# prompt_toolkit switches bracketed paste on each time it starts reading a line: the REPL is waiting.
PROMPT = "\x1b[?2004h"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|[\x08\r]")
LIBRARY_NAMES = re.compile(r"max_kv_size|kv_group_size|kv_bits\(|\.speculative\(|\.cache\(|clear\(\)|GenerateParams\.")


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_path(arch="qwen3", tokenizer="bpe"))


def plain(text):
    return ANSI.sub("", text)


def spawn(*args, tmp_path, env=None, timeout=180):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "TERM": "xterm",
        "PROMPT_TOOLKIT_NO_CPR": "1",  # pexpect is no terminal: nobody answers cursor position requests
        "CHATKIT_HISTORY_FILE": str(tmp_path / "history"),
        **(env or {}),
    }
    env = {k: v for k, v in env.items() if v is not None}
    child = pexpect.spawn(sys.executable, ["-m", "chatkit", *args], env=env, encoding="utf-8",
                          timeout=timeout, dimensions=(40, 200))
    child.expect("Ctrl-D to quit")
    return child


def prompt(child):
    child.expect_exact(PROMPT)
    return plain(child.before)


def ask(child, line):
    """Send a line, return what the REPL printed until its next prompt (escape codes removed)."""
    child.sendline(line)
    return prompt(child)


def interrupted_reply(child, text):
    child.sendline(text)
    child.expect_exact("\x1b[?2004l")  # the line was read: the reply is being generated
    child.expect(r"\w")  # and has started streaming
    child.sendintr()
    child.expect_exact("[stopped]")
    prompt(child)


def run(*args, stdin="", env=None, timeout=120):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "chatkit", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def run_here(*args, stdin=""):
    """``run`` in this process: ``chatkit.cli.main``, which ``python -m chatkit`` exits with (the same
    status and output), for commands that end before a chat starts: a process would only add ~3 s to
    start. Process-level exit statuses are proven by the ``run`` cases (a refused --save, inspect)."""
    out, err = io.StringIO(), io.StringIO()
    given, sys.stdin = sys.stdin, io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse: --help, --version and usage errors
                code = 0 if exc.code is None else exc.code
    finally:
        sys.stdin = given
    return subprocess.CompletedProcess(["chatkit", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.slow  # a subprocess
def test_repl_conversation_with_ctrl_c_save_undo_and_load(model_dir, tmp_path):
    saved, after_undo = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    child = spawn("chat", "--model", model_dir, "--max-tokens", "3000", tmp_path=tmp_path)
    prompt(child)
    child.sendline("Tell me a long story")
    child.expect_exact("\x1b[?2004l")
    child.expect(r"\w")
    child.send("/sta")  # typed while the reply streams: kept for the next prompt, not echoed into the reply
    child.sendintr()
    child.expect_exact("[stopped]")
    prompt(child)
    child.send("ts\r")
    assert "finish: cancelled" in prompt(child)
    assert re.search(r"saved \d+ tokens, 2 messages", ask(child, f"/save {saved}"))
    interrupted_reply(child, "Another one")
    assert "undone: 'Another one'" in ask(child, "/undo")
    assert "error: No cache file" in ask(child, "/load /no/such/file.safetensors")  # one line, goes on
    assert re.search(r"saved \d+ tokens, 2 messages", ask(child, f"/save {after_undo}"))
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    assert "Traceback" not in child.before

    again = spawn("chat", "--model", model_dir, "--max-tokens", "3000", tmp_path=tmp_path)
    prompt(again)
    assert re.search(r"loaded .*: 2 messages, \d+ tokens cached", ask(again, f"/load {after_undo}"))
    interrupted_reply(again, "Go on")
    reused = re.search(r"prompt \d+ tokens \((\d+) reused", ask(again, "/stats"))
    assert int(reused.group(1)) > 0, "the loaded cache was reused"
    again.sendeof()
    again.expect(pexpect.EOF)

    out = run_here("inspect", str(after_undo))
    assert out.returncode == 0 and "turns: 1, messages: 2" in out.stdout and "Tell me a long story" in out.stdout


@pytest.mark.slow  # a subprocess
def test_ctrl_c_during_the_first_reply_while_mlx_compiles_its_kernels(tmp_path):
    """MLX's CPU backend compiles fused kernels with g++ in a child process during the first reply.
    A Ctrl-C that reached that child as SIGINT killed it: "Could not load C++ shared library", turn lost."""
    kernels = tmp_path / "tmp"
    kernels.mkdir()  # an empty TMPDIR: MLX has no compiled kernel yet and must build them now
    child = spawn("chat", tmp_path=tmp_path, env={"TMPDIR": str(kernels)})
    prompt(child)
    child.sendline("My name is Ada.")
    child.expect_exact("\x1b[?2004l")  # the line was read: MLX starts on the reply
    # Wait until the REPL has the terminal in reply mode (echo off, Ctrl-C read as a key): a Ctrl-C
    # before that lands in prompt_toolkit's exit, a race this test is not about.
    time.sleep(0.3)
    deadline = time.monotonic() + 10
    while child.getecho() and time.monotonic() < deadline:
        time.sleep(0.02)
    child.sendintr()  # while the kernels are being compiled
    out = prompt(child)
    assert "[stopped]" in out and "error" not in out, out
    stats = ask(child, "/stats")
    assert "conversation: 2 messages" in stats and "finish: cancelled" in stats  # the stopped reply was kept
    assert "7 + 5 = 12." in ask(child, "What is 7 + 5?")  # and the program goes on
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    assert "Traceback" not in child.before and "Could not load" not in child.before
    assert list(kernels.glob("mlx/*/cpu/*.so")), "the first reply compiled kernels in this run"


@pytest.mark.slow  # a subprocess
def test_line_editing_history_search_paste_and_ctrl_d(tmp_path):
    data = tmp_path / "data"
    env = {"CHATKIT_HISTORY_FILE": None, "XDG_DATA_HOME": str(data)}  # the user's data folder
    child = spawn("chat", tmp_path=tmp_path, env=env)
    prompt(child)
    assert "system prompt set" in ask(child, "/system Be brief.")
    child.send("What is 7 5?" + "\x1b[D" * 2 + "+ \r")  # Left twice, then insert: "What is 7 + 5?"
    assert "7 + 5 = 12." in prompt(child)
    child.send("\x1b[200~My name is\r\nAda.\x1b[201~\r")  # a pasted message of two lines: one message
    prompt(child)
    child.send("What is\x1b\rmy name?\r")  # Esc Enter: a new line inside the message
    prompt(child)
    assert "conversation: 8 messages" in ask(child, "/stats")  # three exchanges, one through the calculator
    child.sendeof()  # Ctrl-D on an empty line: leave, the shell's prompt on a new line
    child.expect(pexpect.EOF)
    assert plain(child.before).endswith("\n") and "Traceback" not in child.before
    history = (data / "chatkit" / "history").read_text()
    assert "+My name is\n+Ada." in history and "+What is\n+my name?" in history and "+What is 7 + 5?" in history

    again = spawn("chat", tmp_path=tmp_path, env=env)
    prompt(again)
    again.send("\x1b[A\r")  # Up: the last line of the last run
    assert "conversation: 0 messages" in prompt(again)
    again.send("\x12sys\r\r")  # Ctrl-R: search the history, Enter takes the match, Enter sends it
    assert "system prompt set" in prompt(again)
    again.sendeof()
    again.expect(pexpect.EOF)


@pytest.mark.slow  # a subprocess
def test_commands_without_a_terminal_and_errors(model_dir, tmp_path):
    script = "\n".join(["Hello", "/retry", "/system Be brief.", "/clear", "/undo", "/help", "/nope", "/quit"]) + "\n"
    out = run("--model", model_dir, "--max-tokens", "5", stdin=script)
    assert out.returncode == 0, out.stderr
    assert "system prompt set" in out.stdout and "cleared" in out.stdout and "/retry" in out.stdout
    assert "error: There is no exchange to undo" in out.stderr and "Traceback" not in out.stderr
    bad = run("inspect", str(tmp_path))
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr


@pytest.mark.slow  # a subprocess
def test_save_into_a_missing_folder_is_refused_at_start(tmp_path):
    target = tmp_path / "no" / "such" / "chat.safetensors"
    out = run("--save", str(target), stdin="My name is Ada.\n")
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "--save" in out.stderr and "does not exist" in out.stderr
    assert not target.parent.exists()
    folder = run("--save", str(tmp_path), stdin="Hi\n")
    assert folder.returncode == 2 and "is a folder" in folder.stderr

    session = run(stdin=f"My name is Ada.\n/save {target}\n/save {tmp_path / 'ok.safetensors'}\n")
    assert session.returncode == 0 and "Traceback" not in session.stderr
    assert "/save" in session.stderr and "does not exist" in session.stderr and "tmp.safetensors" not in session.stderr
    assert "saved" in session.stdout and (tmp_path / "ok.safetensors").is_file()


@pytest.mark.slow  # a subprocess
def test_resume_applies_the_flags_given_with_it(tmp_path):
    saved = tmp_path / "chat.safetensors"
    first = run("--save", str(saved), stdin="My name is Ada.\n")
    assert first.returncode == 0 and saved.is_file(), first.stderr

    plain_resume = run("--resume", str(saved), stdin="What is my name?\n/stats\n")
    assert "Your name is Ada." in plain_resume.stdout and "finish: stop" in plain_resume.stdout

    out = run("--resume", str(saved), "--max-tokens", "2", "--system", "Be brief.", stdin="What is my name?\n/stats\n")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "2 generated" in out.stdout and "finish: length" in out.stdout  # --max-tokens applied
    assert "with a system prompt" in out.stdout  # --system applied
    assert "--system, --max-tokens from the command line override the file's" in out.stderr

    window = run("--resume", str(saved), "--max-kv-size", "16", "--context-policy", "error",  # a plain rotating cache
                 stdin="What is 7 + 5?\nSpell tiger.\n/stats\n")
    assert window.returncode == 0 and "cache: 16 tokens" in window.stdout and "RotatingKVCache" in window.stdout
    assert "not made with --max-kv-size 16" in window.stderr, window.stderr

    draft = run("--resume", str(saved), "--draft", "demo", stdin="What is my name?\n/stats\n")
    assert draft.returncode == 0 and "Your name is Ada." in draft.stdout, draft.stderr
    assert "proposed tokens accepted" in draft.stdout and not LIBRARY_NAMES.search(draft.stderr)


@pytest.mark.slow  # a subprocess
def test_cache_flags_follow_one_rule_and_errors_name_flags(tmp_path):
    quantized = run("--kv-bits", "4", stdin="My name is Ada.\nWhat is my name?\n/stats\n")
    assert quantized.returncode == 0, quantized.stderr  # a group size dividing the demo's head size (32)
    assert "Your name is Ada." in quantized.stdout and "QuantizedKVCache" in quantized.stdout

    refusals = {
        ("--kv-bits", "4", "--kv-group-size", "64"): "--kv-group-size 32",
        ("--max-kv-size", "0"): "use 8 or more, or leave the flag out",
        ("--max-kv-size", "5"): "use 8 or more, or leave the flag out",
        ("--kv-bits", "7"): "--kv-bits",
        ("--draft", "demo", "--max-kv-size", "64"): "--draft with a model cannot be combined with --max-kv-size",
        ("--kv-bits", "4", "--max-kv-size", "64"): "--kv-bits cannot be combined with --max-kv-size",
        ("--temp", "-1"): "--temp",
        ("--max-tokens", "0"): "--max-tokens",
    }
    for flags, expected in refusals.items():
        out = run_here(*flags, stdin="Hi\n")
        assert out.returncode == 2 and expected in out.stderr, (flags, out.stderr)
        assert "Traceback" not in out.stderr and not LIBRARY_NAMES.search(out.stderr), (flags, out.stderr)
    helped = run_here("chat", "--help")
    assert "N >= 8 (default: no limit)" in " ".join(helped.stdout.split())
    for flags in (("--draft", "demo", "--kv-bits", "8"),
                  ("--draft", "prompt_lookup", "--max-kv-size", "64", "--context-policy", "error")):  # a rotating cache
        out = run(*flags, stdin="My name is Ada.\nWhat is my name?\n/stats\n")  # speculative over these caches
        assert out.returncode == 0 and "Your name is Ada." in out.stdout, (flags, out.stderr)
        assert "proposed tokens accepted" in out.stdout, (flags, out.stdout)


@pytest.mark.slow  # a subprocess
def test_a_message_longer_than_the_context_window(tmp_path):
    alone = run(stdin=" ".join(["word"] * 1100) + "\nMy name is Ada.\n")
    assert alone.returncode == 0 and "Nice to meet you, Ada." in alone.stdout  # and the chat goes on
    assert "Send a shorter message" in alone.stderr and "would not help" in alone.stderr

    system = " ".join(["Answer briefly."] * 330)  # ~990 of the demo's 1,024 tokens: one exchange fits
    script = "My name is Ada.\nSpell tiger.\nSpell lion.\n/stats\n"
    full = run("--system", system, "--context-policy", "error", stdin=script)
    assert "context window" in full.stderr and "/undo drops the last exchange" in full.stderr, full.stderr
    assert "--context-policy rolling" in full.stderr
    assert "last turn: failed" in full.stdout and "conversation: 2 messages" in full.stdout
    rolling = run("--system", system, stdin=script)  # the default: the chat goes on, the oldest exchange dropped
    assert rolling.returncode == 0 and "error" not in rolling.stderr, rolling.stderr
    assert "The word lion is spelled" in rolling.stdout and "conversation: 6 messages" in rolling.stdout
    assert "· context compacted: dropped 2 earlier messages" in rolling.stderr


@pytest.mark.slow  # a subprocess
def test_stats_report_what_the_cache_holds(tmp_path):
    out = run(stdin="My name is Ada.\n/stats\nWhat is 7 + 5?\n/undo\n/stats\n/clear\n/stats\n")
    first, undone, cleared = out.stdout.split("conversation:")[1:]
    assert "prompt 23 tokens" in first and "32 tokens" in first  # the demo's tool in the system turn
    assert "last turn: undone" in undone and "prompt" not in undone and "2 messages" in undone
    assert "cache: empty" in cleared and "last turn: none since /clear" in cleared and "layers" not in cleared

    rotating = run("--max-kv-size", "50", "--context-policy", "error",
                   stdin="My name is Ada.\nWhat is 7 + 5?\nSpell tiger.\nI live in Lyon.\n/stats\n")
    assert rotating.returncode == 0, rotating.stderr
    assert "cache: 50 tokens" in rotating.stdout and "window of the last 50 tokens" in rotating.stdout


@pytest.mark.slow  # a subprocess
def test_a_chat_past_its_window_goes_on_and_says_what_it_dropped(tmp_path):
    """The default policy (rolling) keeps a chat going past its window (here --max-kv-size's): a notice
    line when a turn compacts, /context showing the window, the tokens in use and what was dropped."""
    script = ["My name is Ada.", "What is 7 + 5?", "I live in Lyon.", "Spell tiger.", "Where do I live?", "/context",
              f"/save {tmp_path / 'chat.safetensors'}", "/help"]
    out = run("--max-kv-size", "96", "--max-tokens", "24", stdin="\n".join(script) + "\n")
    assert out.returncode == 0 and "Traceback" not in out.stderr and "error" not in out.stderr, out.stderr
    notices = re.findall(r"· context compacted: dropped (\d+) earlier messages \((\d+) tokens\)", out.stderr)
    assert notices and all(int(n) >= 2 and int(t) > 0 for n, t in notices)
    assert "Noted: you live in Lyon." in out.stdout and "The word tiger is spelled t-i-g-e-r." in out.stdout
    used = re.search(r"context: (\d+) of 96 tokens in use", out.stdout)
    assert used and int(used.group(1)) <= 96 and "policy: rolling" in out.stdout
    dropped = re.search(r"dropped: (\d+) of (\d+) messages are no longer shown", out.stdout)
    assert dropped and int(dropped.group(1)) == sum(int(n) for n, _ in notices) and dropped.group(2) == "12"
    assert "/context       the context window" in out.stdout  # in /help

    # Resumed, the file's policy goes on unless the flag says otherwise; summarize shows its summary.
    resumed = run("--resume", str(tmp_path / "chat.safetensors"), stdin="/context\n")
    assert "policy: rolling" in resumed.stdout and "of 96 tokens" in resumed.stdout, resumed.stderr
    summarized = run("--resume", str(tmp_path / "chat.safetensors"), "--context-policy", "summarize",
                     "--max-tokens", "24", stdin="My name is Ada.\nSpell lion.\nWhat is 2 + 2?\n/context\n")
    assert summarized.returncode == 0 and "Traceback" not in summarized.stderr, summarized.stderr
    assert "--context-policy from the command line overrides" in summarized.stderr or \
        "--context-policy from the command line override the file's" in summarized.stderr
    assert "policy: summarize" in summarized.stdout and "\nsummary: " in summarized.stdout
    assert re.search(r"· context compacted: .*summary \d+ tokens", summarized.stderr), summarized.stderr

    bad = run("--context-policy", "forget", stdin="Hi\n")
    assert bad.returncode == 2 and "--context-policy" in bad.stderr and "'rolling'" in bad.stderr
    assert "Traceback" not in bad.stderr


class _Terminal:
    """A stand-in for a terminal's stderr (so notes are dimmed), collecting what is printed."""

    def __init__(self):
        import io

        self.buffer = io.StringIO()
        self.write, self.flush = self.buffer.write, self.buffer.flush

    def isatty(self):
        return True


def test_the_repl_prepares_the_next_compaction_while_the_user_types():
    import io
    import threading

    from chatkit import ContextPolicy
    from chatkit.cli import Repl, parser
    from chatkit.cli.compaction import context_report

    calls = []

    def summarizer(messages):
        calls.append(threading.current_thread().name)
        return "The user is Ada."

    lines = ["My name is Ada.", "I live in Lyon.", "Spell tiger.", "Spell lion.", "I live in Oslo.", "Spell horse.",
             "Call me Bo.", "Spell zebra.", "I live in Rome."]
    repl = Repl(parser().parse_args(["chat", "--max-kv-size", "128", "--max-tokens", "24"]), out=io.StringIO(),
                err=_Terminal())
    repl.session.context_policy = ContextPolicy.summarize(summarizer=summarizer, high_water=0.6)
    for line in lines:
        repl.prepared()  # as the loop does before it handles the next line
        repl.turn(line)  # the reply, then the preparation starts on its thread
        if repl.session.last_stats.compacted:
            break
    repl.prepared()
    stats = repl.session.last_stats
    assert stats.compacted and stats.prefilled_tokens < 30  # the compacted context was prefilled ahead
    # every summary was written between turns (on the preparing thread's own summarizer thread: its timeout)
    assert calls and set(calls) == {"chatkit-prepare/summarizer"}
    shown = repl.err.buffer.getvalue()
    assert "\x1b[2m· context compacted: dropped" in shown and f"summary {stats.summary_tokens} tokens" in shown
    assert "summary: The user is Ada." in context_report(repl.session)

    def broken(messages):
        raise RuntimeError("no summaries today")

    repl.prepared()
    repl.session.context_policy = ContextPolicy.summarize(summarizer=broken, high_water=0.6)
    for line in lines:
        repl.turn(line)
        repl.prepared()
        if "could not be prepared ahead" in repl.err.buffer.getvalue():
            break
    shown = repl.err.buffer.getvalue()
    assert "\x1b[2m· the next compaction could not be prepared ahead (The context policy's summarizer failed" in shown
    repl.session.context_policy = ContextPolicy.rolling()  # the chat goes on
    repl.turn("Spell tiger.")
    assert repl.last.stats is not None and "Traceback" not in shown


@pytest.mark.slow  # a subprocess
def test_version_help_and_inspect(tmp_path):
    version = run_here("--version")
    assert version.returncode == 0 and re.match(r"chatkit \d+\.\d+\.\d+ \(mlx .*, mlx-lm .*\)", version.stdout)
    helped = run_here("chat", "--help").stdout
    assert "demo model" in helped and "(default: 256" in helped and "/retry" in helped and "Ctrl-R" in helped
    assert "auto it decodes plainly" in " ".join(helped.split())  # --draft with the demo on a CPU

    saved = tmp_path / "chat.safetensors"
    turns = ["My name is Ada.", "What is 7 + 5?", "Spell tiger.", "I live in Lyon."]
    assert run("--save", str(saved), stdin="\n".join(turns) + "\n").returncode == 0
    out = run_here("inspect", str(saved))
    assert out.returncode == 0 and "the last 6 of 10 messages (--all shows every one)" in out.stdout
    assert "My name is Ada." not in out.stdout
    assert re.search(r"^  architecture +[0-9a-f]{16}$", out.stdout, re.M)
    every = run_here("inspect", "--all", "--model", "demo", str(saved))
    assert every.returncode == 0 and "10 messages:" in every.stdout and "My name is Ada." in every.stdout
    assert "fits demo: yes" in every.stdout
    foreign = run_here("inspect", "--model", str(tiny_model_path(arch="qwen3", tokenizer="bpe")), str(saved))
    assert foreign.returncode == 1 and "another model" in foreign.stderr and "Traceback" not in foreign.stderr


def _edit_metadata(path, **changes):
    """Rewrite chatkit's JSON in a saved file's safetensors header (the tensors stay as they are)."""
    import json
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k, v in header["__metadata__"].items() if k.endswith("chatkit"))
    header["__metadata__"][key] = json.dumps({**json.loads(header["__metadata__"][key]), **changes})
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "chat.safetensors"
    assert run("--save", str(path), stdin="My name is Ada.\n").returncode == 0
    return path


@pytest.mark.parametrize("damage", ["truncated", "text", "missing", "folder", "messages: 5",
                                    "fingerprint: a string", "generate_params: a list"])
def test_inspect_and_resume_on_a_bad_file_print_one_line(tmp_path, good_file, damage):
    bad = tmp_path / "bad.safetensors"
    if damage == "truncated":
        bad.write_bytes(good_file.read_bytes()[:100])
    elif ":" in damage:  # valid JSON of the wrong types
        bad.write_bytes(good_file.read_bytes())
        field = damage.split(":")[0]
        _edit_metadata(bad, **{field: {"messages": 5, "fingerprint": "abc", "generate_params": [1]}[field]})
    elif damage == "text":
        bad.write_text("not a cache file\n")
    elif damage == "folder":
        bad.mkdir()
    for args in (["inspect", str(bad)], ["--resume", str(bad)]):
        out = run_here(*args, stdin="Hi\n")
        assert out.returncode in (1, 2) and out.stderr.startswith("error:"), (args, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, (args, out.stderr)
        assert "bad.safetensors" in out.stderr, (args, out.stderr)  # names the file


@pytest.mark.slow
def test_the_readme_says_which_phrasings_the_demo_understands():
    """Every phrasing in README's table gets the documented reply from the demo (greedy, fresh session;
    questions marked "after telling it" come after the facts of the table's first phrasings)."""
    import chatkit
    from chatkit import ChatSession, GenerateParams

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("<!-- demo-phrasings")[1].split("<!-- /demo-phrasings -->")[0]
    rows = []
    for line in table.splitlines():
        if line.startswith("| `"):
            say, answer = (cell.strip() for cell in line.strip("|").split("|"))
            said = [s for s in re.findall(r"`([^`]+)`", say) if s != "calculate"]
            rows.append((said, answer.strip("`"), "(after telling it)" in say))
    assert len(rows) >= 15
    tell = [said[0] for said, answer, _ in rows if answer.startswith(("Nice to meet you", "Noted:"))]
    lm = chatkit.load("demo")
    wrong = []
    for said, answer, recall in rows:
        for phrasing in said:
            session = ChatSession.builder(lm).tools(chatkit.demo.tools()).generate_params(GenerateParams(max_tokens=64)).build()
            for fact in tell if recall else ():
                session.respond(fact)
            reply = session.respond(phrasing)
            if reply != answer:
                wrong.append((phrasing, reply, answer))
    assert not wrong


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
        repl.reply(lambda repl=repl: repl.session.stream_respond("Weather in Oslo?"), "Weather in Oslo?")
        shown = out.getvalue()
        assert ("Check Oslo." in shown) is shows_reasoning and "<think>" not in shown and "<tool_call>" not in shown
        assert '[tool call] get_weather({"city": "Oslo"})' in shown and "[tool result] sunny in Oslo" in shown
        assert shown.rstrip().endswith("It is sunny.")


def test_tools_flag_names_what_cannot_be_imported():
    out = run_here("--tools", "no_such_module_here:f", stdin="Hi\n")
    assert out.returncode == 2 and "--tools" in out.stderr and "module:function" in out.stderr.lower()
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # a subprocess
def test_the_demo_in_a_terminal_with_names_and_numbers_it_never_trained_on(tmp_path):
    """What a new user types first: held-out names (scripts/train_demo.py never shows them), a sum
    through the calculator tool the chat gives the demo, a question about what was never told."""
    child = spawn("chat", tmp_path=tmp_path)
    prompt(child)
    assert "Nice to meet you, Noor." in ask(child, "My name is Noor.")
    out = ask(child, "What is 25 + 30?")
    assert '[tool call] calculate({"expression": "25 + 30"})' in out and "[tool result] 55" in out
    assert out.rstrip().endswith("25 + 30 = 55.")
    assert "Your name is Noor." in ask(child, "What did I say my name was?")
    assert "I don't know where you live: you have not told me." in ask(child, "Where do I live?")
    ask(child, "/clear")
    assert "Nice to meet you, Zbigniew." in ask(child, "Call me Zbigniew.")
    assert "Noted: you live in Ljubljana." in ask(child, "I live in Ljubljana.")
    assert "1234 + 5678 = 6912." in ask(child, "What is 1234 + 5678?")
    assert "You live in Ljubljana." in ask(child, "Where do I live?")
    assert "I don't know: you have not told me about a pet." in ask(child, "What is my dog called?")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    assert "Traceback" not in child.before
