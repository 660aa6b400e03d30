"""Every example runs offline on the bundled demo pair."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example is a fresh process that loads the demo pair

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run(name, *args, stdin="", cwd=None):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        input=stdin, capture_output=True, text=True, timeout=240, env=ENV, cwd=cwd,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    return out.stdout


def test_streaming_chat():
    out = run("streaming_chat.py", stdin="What is 2 + 3?\nMy name is Ada.\n\n")
    assert out.count("tokens,") == 2 and "prompt tokens from the cache" in out


def test_persist_and_resume_in_a_new_process(tmp_path):
    out = run("persist_and_resume.py", "--file", str(tmp_path / "chat.safetensors"), cwd=tmp_path)
    assert "[new process" in out and "2 turns" in out
    assert "Ada" in out.split("What is my name?")[-1], "the resumed session remembers the fact"


def test_speculative_example():
    out = run("speculative.py")
    assert out.count("same as without draft: True") == 4
    assert "draft accepted" in out


def test_app_integration():
    out = run("app_integration.py")
    stopped = next(line for line in out.splitlines() if line.startswith("stopped after"))
    shown = stopped.split("shown: ")[1].split("; kept: ")[0].strip("'")
    kept = stopped.split("; kept: ")[1].strip("'")
    full = ("I remember what you tell me about yourself, do arithmetic with my calculate tool, spell and count "
            "letters, repeat after you and fill in a JSON form.")
    assert shown and kept.startswith(shown) and full.startswith(kept) and len(kept) < len(full), stopped
    assert "bot> Your name is Ada." in out and "worker thread bot> 2 + 3 = 5." in out


def test_guided_example():
    out = run("guided.py")
    person = out.split("(output=Person)\n")[1].splitlines()[0]
    assert person == "Person(name='Ada', city='Oslo')", person  # both facts copied from the message
    committed = out.split("committed reply: ")[1].splitlines()[0]
    assert json.loads(committed) == {"name": "Ada", "city": "Oslo", "colour": "teal"}, committed  # from the chat
    partials = [line for line in out.splitlines() if line.startswith("  partial: ")]
    assert len(partials) >= 2, "the object fills in while it streams"
    # The regex without its description (include_schema=False), which the demo never saw: the name is copied.
    assert out.split("(regex)\n")[1].splitlines()[0] == "Your name is Ada."
    assert "IncompleteOutputError" in out
    assert out.rstrip().endswith("Your favourite colour is teal."), "the session stays usable"


def test_tools_example():
    out = run("tools.py")
    assert "[call] get_weather({'city': 'Lisbon'})" in out and "[call] local_time({'city': 'Lisbon'})" in out
    assert '[result] {"city": "Lisbon", "sky": "sunny", "temperature": 21}' in out and "[result] 14:05 in Lisbon" in out
    assert "rounds: 2" in out and "tool      content='14:05 in Lisbon'" in out
    assert "the model asks for get_weather({'city': 'Porto'})" in out and "bot> Porto is sunny too." in out
