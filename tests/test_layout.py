"""The house rules of the package layout: no import cycle among fedasync's modules, no module
much over 500 lines, every package says what lives in it, and no CLI command module imports
another (shared pieces live in ``cli/common.py`` or below the CLI)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fedasync"
MAX_LINES = 550
SIZE_EXEMPT: tuple[str, ...] = ()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """fedasync modules ``path`` imports, at the top or inside functions (lazy imports count: a
    cycle through them is still a tangle); ``if TYPE_CHECKING:`` blocks do not."""
    me = module_name(path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for n in child.orelse:
                    visit(n)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name in mods)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = me.split(".") if is_pkg else me.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    if sub in mods:
                        out.add(sub)
                    elif base in mods:
                        out.add(base)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    out.discard(me)
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sccs


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, mods) for m, p in mods.items()}


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_lazy_and_relative_imports():
    g = import_graph()
    assert "fedasync.server.transport" in g["fedasync.server.loop"]
    assert "fedasync.store.schema" in g["fedasync.store.store"]
    assert "fedasync.server.loop" in g["fedasync.runs"]  # imported inside run_configs


def test_no_import_cycle():
    assert find_cycles(import_graph()) == []


def test_no_module_over_the_size_limit():
    big = {}
    for name, p in modules().items():
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith(SIZE_EXEMPT):
            continue
        n = len(p.read_text().splitlines())
        if n > MAX_LINES:
            big[rel] = n
    assert big == {}, f"split these along their seams: {big}"


def test_every_package_says_what_lives_in_it():
    for init in ROOT.rglob("__init__.py"):
        if "migrations" in init.parts:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 20, f"{init.relative_to(ROOT.parent)}: no docstring"


def test_no_cli_command_module_imports_another():
    g = import_graph()
    shared = {"fedasync.cli", "fedasync.cli.common", "fedasync.cli.peers"}  # shared pieces, no commands
    for m, deps in g.items():
        if m.startswith("fedasync.cli.") and m not in shared:
            others = {d for d in deps if d.startswith("fedasync.cli") and d not in shared}
            assert not others, f"{m} imports {sorted(others)}: move the shared pieces to cli/common.py or below"
