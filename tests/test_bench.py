"""Every benchmark script runs end to end: ``bench/<name>.py --quick`` (seconds on the tiny models).

The scripts are found by glob, so a new ``bench/*.py`` is covered without editing this file; each must
take ``--quick`` (bench/_common.py: ``add_quick`` and ``quick``), exit 0, and leave the committed results
(bench/results/, docs/) as they are.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.scripts

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def test_the_benchmarks_are_found():
    names = {p.stem for p in SCRIPTS}
    assert {"turns", "server", "batch", "speculative"} <= names, names


def committed_files() -> dict[Path, int]:
    files = [*(BENCH / "results").glob("*"), *(ROOT / "docs").glob("*")]
    return {p: p.stat().st_mtime_ns for p in files if p.is_file()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_runs_quick(script):
    before = committed_files()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, str(script), "--quick"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=540)
    assert out.returncode == 0, f"{script.name} --quick failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{script.name} --quick printed nothing"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert committed_files() == before, f"{script.name} --quick changed files in bench/results/ or docs/"
