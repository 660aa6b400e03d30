"""Every ```python snippet in README.md and docs/*.md runs as written: each file's snippets in order, in
one namespace (a reader's session), in a fresh process with a scratch working folder."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.slow


def snippets(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", [f for f in FILES if snippets(f)], ids=lambda p: p.name)
def test_snippets_run_as_written(path, tmp_path):
    blocks = snippets(path)
    program = "\n".join(f"# --- snippet {i + 1}\n{code}" for i, code in enumerate(blocks))
    (tmp_path / "snippets.py").write_text(program, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("CHATKIT_PROMPT_CACHE", None)  # a reader's process: the prompt cache on, as by default
    out = subprocess.run([sys.executable, "snippets.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"{path.name}: {out.stderr[-3000:]}"


def test_the_readme_has_snippets():
    assert len(snippets(ROOT / "README.md")) >= 4
