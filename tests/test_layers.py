"""The layers you can see: no import cycle among densefit's modules counting the imports
inside functions too, and every import inside a function says why it is there (an optional
extra, or a framework kept off a path). The layer order itself is import-linter's contract
(pyproject.toml, `lint-imports` in scripts/test.sh)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "densefit"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path, names: dict) -> list[tuple[str, int, bool, bool]]:
    """(densefit module imported, line, inside a function, commented) of every import."""
    lines = path.read_text().split("\n")
    out = []

    def resolve(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            deeper = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    targets = [base] + [f"{base}.{a.name}" for a in child.names]
                text = lines[child.lineno - 1 : child.end_lineno]
                above = lines[child.lineno - 2].strip() if child.lineno > 1 else ""
                commented = any("#" in t for t in text) or above.startswith("#")
                for target in targets:
                    hit = resolve(target) if target.startswith("densefit") else None
                    out.append((hit or target, child.lineno, deeper, commented))
            visit(child, deeper)

    visit(ast.parse("\n".join(lines)), False)
    return out


def test_no_import_cycle_counting_imports_inside_functions():
    names = modules()
    graph = {m: set() for m in names}
    for module, path in names.items():
        for target, *_ in imports(path, names):
            if target in names and target != module:
                graph[module].add(target)
    # Tarjan's strongly connected components
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert cycles == [], f"import cycles: {cycles}"


def test_every_import_inside_a_function_says_why():
    names = modules()
    silent, internal = [], []
    for module, path in names.items():
        for target, line, inside, commented in imports(path, names):
            if not inside:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line} ({target})"
            if not commented:
                silent.append(where)
            if target in names and not module.startswith("densefit.cli"):
                internal.append(where)  # only the CLI defers its jobs (--help stays light)
    assert silent == [], "imports inside functions without a comment saying why: " + ", ".join(
        sorted(set(silent))
    )
    assert internal == [], "densefit imports inside functions outside the CLI: " + ", ".join(
        sorted(set(internal))
    )
