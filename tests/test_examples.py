"""Every example runs offline on the bundled demo pair."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO = Path(__file__).resolve().parent.parent / "chatkit" / "demo" / "models" / "chat" / "config.json"
pytestmark = pytest.mark.skipif(not DEMO.exists(), reason="the demo model pair is not trained yet")
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
    assert "stopped after 5 chunks" in out and "worker thread bot>" in out
    assert out.count("bot>") == 3
