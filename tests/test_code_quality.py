"""The project's habits, checked with the suite: ruff (lint and import order) and mypy, as configured in
pyproject.toml."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.lint


def run(*args):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff():
    out = run("ruff", "check", "chatkit", "tests", "bench", "scripts", "examples")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_mypy():
    out = run("mypy")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_tools_are_installed():
    # The test extra installs them; a missing tool must fail, not skip.
    assert shutil.which("ruff") or run("ruff", "--version").returncode == 0
