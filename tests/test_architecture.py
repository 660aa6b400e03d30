"""The package's shape, checked: layers import only downwards, no import circles (lazy imports and
``TYPE_CHECKING`` ones included), and the size limits of functions and modules (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "chatkit"

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS = [
    {"errors", "images", "messages", "params", "distributed", "_blas", "_cachedir", "_version"},
    {"model"},
    {"text"},
    {"cache"},
    {"decode"},
    {"tools", "guided"},
    {"session"},
    {"server"},
    {"cli"},  # `chatkit serve` starts the server; the server never imports the CLI
]
OUTSIDE = {"testing", "demo", "__init__", "__main__"}  # the public root, test models, bundled data


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The chatkit modules ``name`` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "chatkit"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "chatkit":
                target = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


def layer(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else "__init__"
    if top in OUTSIDE or module.endswith(".__main__"):  # entry scripts (python -m ...) may start any face
        return None
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def test_layers_point_down():
    upward = [
        f"{a} -> {b}"
        for a, targets in GRAPH.items() for b in targets
        if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)  # type: ignore[operator]
    ]
    below_root = [f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                  if b == "chatkit" and a.split(".")[1:2] != ["testing"]]
    assert not upward, "imports that point up the layers:\n" + "\n".join(sorted(upward))
    assert not below_root, "modules that import the package root:\n" + "\n".join(sorted(below_root))


def test_no_import_circles():
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1  # type: ignore[operator]


@pytest.mark.parametrize("limit, packages", [(50, ("session", "decode", "cache")), (80, None)])
def test_functions_are_short(limit, packages):
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {fn} ({n} lines)"
        for name, path in modules().items()
        if packages is None or name.split(".")[1:2] and name.split(".")[1] in packages
        for fn, line, n in functions(path) if n > limit
    ]
    assert not long, f"functions over {limit} lines:\n" + "\n".join(long)


def test_modules_are_small():
    big = [f"{p.relative_to(PACKAGE.parent)} ({n} lines)" for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 450]
    assert not big, "modules over 450 lines:\n" + "\n".join(big)
