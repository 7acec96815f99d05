"""The architecture's rules, checked on the source: data flows one way, so no module of the
project imports another in a circle (imports inside functions count), and worker/ is a
library that knows nothing of Django or the site."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("leaderboard", "worker")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name an import statement anywhere in the file (functions included) can
    refer to: `from a.b import c` gives a.b and a.b.c (c may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}, each import resolved to the longest
    project module that it names."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in imported_names(name, path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_module_of_the_project_imports_another_in_a_circle():
    graph = import_graph()
    assert "leaderboard.tasks" in graph and "worker.measure" in graph  # the graph is read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    # The rule's own check: a circle made only by an import inside a function is found.
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("from a import x\n")
    graph = {m: {d for d in imported_names(m, tmp_path / f"{m}.py") if d in "abc"}
             for m in "abc"}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = set()
    assert find_cycle(graph) is None


def test_worker_imports_nothing_of_django_or_the_site():
    graph_names = {name: imported_names(name, path)
                   for name, path in project_modules().items() if name.startswith("worker")}
    assert "worker.measure" in graph_names
    leaks = {name: sorted(i for i in imported if i.split(".")[0] in ("django", "leaderboard"))
             for name, imported in graph_names.items()}
    assert {name: found for name, found in leaks.items() if found} == {}
