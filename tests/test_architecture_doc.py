"""docs/architecture.md names every module of the package, and only modules that exist.

The package tree is the first code block after "## The package". A line that starts (at most two
spaces in) with a path ending in ``/`` opens that package (``chatkit/`` is the root, ``decode/batch/``
a subpackage) and names its ``__init__.py``; every ``name.py`` on that line and the lines after it,
up to the next package line, names ``package/name.py``.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "chatkit"
DOC = ROOT / "docs" / "architecture.md"

PACKAGE_LINE = re.compile(r"^ {0,2}((?:\w+/)+)(?=\s|$)")
MODULE = re.compile(r"(?<![\w/.])([A-Za-z_]\w*\.py)\b")


def tree(text: str) -> list[str]:
    """The lines of the package tree."""
    lines = text.splitlines()
    at = lines.index("## The package")
    start = next(i for i in range(at, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start + 1 : end]


def named(lines: list[str]) -> set[str]:
    """The modules the tree names, as paths relative to ``chatkit/``."""
    found: set[str] = set()
    package = None
    for line in lines:
        opened = PACKAGE_LINE.match(line)
        if opened:
            path = opened.group(1)
            package = "" if path == "chatkit/" else path
            found.add(f"{package}__init__.py")
            line = line[opened.end() :]
        if package is None:
            continue
        found |= {f"{package}{name}" for name in MODULE.findall(line)}
    return found


def modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}


def test_the_architecture_doc_names_every_module():
    missing = sorted(modules() - named(tree(DOC.read_text())))
    assert not missing, (
        "modules docs/architecture.md does not name (add each to the package tree, under its package's "
        "line, with a few words on what it holds):\n" + "\n".join(missing)
    )


def test_the_architecture_doc_names_no_module_that_does_not_exist():
    stale = sorted(named(tree(DOC.read_text())) - modules())
    assert not stale, "docs/architecture.md names modules that do not exist (renamed or removed?):\n" + "\n".join(stale)


def test_the_tree_reader_sees_a_missing_module_and_a_stale_one():
    lines = ["chatkit/    errors.py", "  text/     reply.py (PieceKind)  gone.py", "            more.py"]
    assert named(lines) == {"__init__.py", "errors.py", "text/__init__.py", "text/reply.py", "text/gone.py",
                            "text/more.py"}
    assert "decode/local.py" not in named(lines)
