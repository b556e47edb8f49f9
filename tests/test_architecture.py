"""docs/architecture.md is true to the code: every module is in its module table with what it
imports, every import runs down the documented layers, no file is over 600 lines and no
function over 60, and the package's top holds at most 15 modules besides its packages.

On a failure the message gives the row to paste into the table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "holmes_sim"
DOC = REPO / "docs" / "architecture.md"
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_TOP_MODULES = 600, 60, 15


def _modules() -> list[Path]:
    """Every non-empty Python or C source file of the package, relative to the package."""
    files = sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c")])
    return [f.relative_to(PACKAGE) for f in files if f.read_text().strip()]


def _unit(rel: Path) -> str:
    """The layer unit of a module: its top package (`estimate`), or the top module (`cli`)."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _dotted_unit(name: str) -> str | None:
    """The unit of `holmes_sim.a.b...` (None for the package root or a name defined there)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    first = parts[1]
    if (PACKAGE / first).is_dir() or (PACKAGE / f"{first}.py").exists():
        return first
    return None


def _imported_units(rel: Path) -> set[str]:
    """The units a module imports (at any depth: lazy and TYPE_CHECKING imports count)."""
    if rel.suffix != ".py":
        return set()
    tree = ast.parse((PACKAGE / rel).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    units = {_dotted_unit(n) for n in names if n.startswith("holmes_sim")}
    return {u for u in units if u is not None} - {_unit(rel)}


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under `## heading` in the architecture doc, cells stripped."""
    text = DOC.read_text()
    section = text.split(f"\n## {heading}\n", 1)
    assert len(section) == 2, f"docs/architecture.md has no '## {heading}' section"
    rows = []
    for line in section[1].splitlines():
        if line.startswith("## "):
            break
        if line.startswith("|") and not re.match(r"\|\s*-", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # without the header


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _layers() -> dict[str, int]:
    layers = {}
    for row in _table("Layers"):
        for unit in _ticked(row[1]):
            layers[unit.rstrip("/").removesuffix(".py")] = int(row[0])
    return layers


def _documented() -> dict[str, set[str]]:
    out = {}
    for row in _table("Modules"):
        module = _ticked(row[0])[0]
        imports = row[-1]
        out[module] = set() if imports in ("-", "") else {u.rstrip("/") for u in _ticked(imports)}
    return out


def _row(rel: Path) -> str:
    imports = ", ".join(f"`{u}`" for u in sorted(_imported_units(rel))) or "-"
    return f"| `{rel.as_posix()}` | ... | {imports} |"


def test_every_module_is_documented_with_its_imports():
    documented = _documented()
    wrong = [_row(rel) for rel in _modules()
             if documented.get(rel.as_posix()) != _imported_units(rel)]
    stale = sorted(set(documented) - {rel.as_posix() for rel in _modules()})
    assert not wrong, "rows missing or wrong in docs/architecture.md:\n" + "\n".join(wrong)
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"


def test_imports_run_down_the_layers():
    layers = _layers()
    units = {_unit(rel) for rel in _modules()}
    assert units <= set(layers), f"units without a layer: {sorted(units - set(layers))}"
    upward = [f"{rel.as_posix()} (layer {layers[_unit(rel)]}) imports {u} (layer {layers[u]})"
              for rel in _modules() for u in _imported_units(rel)
              if layers[u] >= layers[_unit(rel)]]
    assert not upward, "imports that run up or across the layers:\n" + "\n".join(upward)


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks (type-only imports)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                stack.extend(child.orelse)
            else:
                stack.append(child)


def test_a_package_imports_its_own_modules_without_cycles():
    graph: dict[str, set[str]] = {}
    for rel in _modules():
        if rel.suffix != ".py":
            continue
        me = ".".join(("holmes_sim", *rel.with_suffix("").parts)).removesuffix(".__init__")
        tree = ast.parse((PACKAGE / rel).read_text())
        deps = set()
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        pkg = me.rsplit(".", 1)[0]
        graph[me] = {d for d in deps if d.startswith(pkg + ".") and d != me and d != pkg}
    modules = set(graph)
    graph = {m: {d for d in ds if d in modules} for m, ds in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, f"import cycle: {' -> '.join(path + [m])}"
        state[m] = 1
        for d in sorted(graph[m]):
            visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


def test_no_file_over_600_lines():
    long = {rel.as_posix(): n for rel in _modules()
            if (n := len((PACKAGE / rel).read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"split these by concern: {long}"


def test_no_function_over_60_lines():
    long = []
    for rel in (r for r in _modules() if r.suffix == ".py"):
        for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "shorten these functions:\n" + "\n".join(long)


def test_the_top_of_the_package_stays_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top of holmes_sim/: {top}"
