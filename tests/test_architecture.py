"""The architecture's rules, checked on the source: data flows one way, so no module of the
project imports another in a circle (imports inside functions count), nor does a package
(leaderboard.selectors, worker.methods...) loop through another; worker/ is a library that
knows nothing of Django, the site or the demo; the demo (demo/) may read the site."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("leaderboard", "worker", "demo")


def project_modules(root: Path = ROOT, packages=PACKAGES) -> dict[str, Path]:
    modules = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(root).with_suffix("").parts
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


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """{module: the project modules it imports}, each import resolved to the longest
    project module that it names."""
    modules = project_modules() if modules is None else modules
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


def package_of(module: str, packages: set[str]) -> str:
    """The node a module counts as in the package graph: the subpackage it lies in
    (leaderboard.selectors, worker.methods; leaderboard.management for its commands), or
    itself for a top-level package's own modules (leaderboard.views, leaderboard.models),
    else views -> selectors -> models would read as a loop of `leaderboard`."""
    subpackage = ".".join(module.split(".")[:2])
    return subpackage if subpackage in packages else module


def package_graph(graph: dict[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    """The module graph with every subpackage collapsed to one node."""
    collapsed: dict[str, set[str]] = {}
    for module, deps in graph.items():
        node = package_of(module, packages)
        collapsed.setdefault(node, set()).update(
            package_of(d, packages) for d in deps if package_of(d, packages) != node)
    return collapsed


def packages_of(modules: dict[str, Path]) -> set[str]:
    """The project's packages: the modules that are a folder's __init__.py."""
    return {name for name, path in modules.items() if path.name == "__init__.py"}


def import_chain(graph: dict[str, set[str]], packages: set[str], importer: str,
                 imported: str) -> list[str] | None:
    """The shortest chain of imports from a module of package `importer` to a module of
    package `imported`, directly or through other modules; None when there is none."""
    queue = sorted(m for m in graph if package_of(m, packages) == importer)
    came_from = {m: None for m in queue}
    for module in queue:  # breadth first: the queue grows as it is read
        for dep in sorted(graph.get(module, ())):
            if dep in came_from:
                continue
            came_from[dep] = module
            if package_of(dep, packages) == imported:
                chain = [dep]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            queue.append(dep)
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


def test_no_package_of_the_project_imports_another_in_a_loop():
    modules = project_modules()
    packages = packages_of(modules)
    graph = package_graph(import_graph(modules), packages)
    # the graph is read, with the subpackages as nodes and the top-level modules beside them
    assert {"leaderboard.selectors", "leaderboard.services", "worker.methods",
            "leaderboard.views", "demo.app"} <= set(graph)
    assert "leaderboard.selectors.protocols" not in graph
    cycle = find_cycle(graph)
    assert cycle is None, "package loop: " + " -> ".join(cycle)


@pytest.mark.parametrize("importer, imported", [
    # selectors read; services write, and may read through selectors
    ("leaderboard.selectors", "leaderboard.services"),
    # each method has one home in worker.methods; the engines run methods, not the reverse
    ("worker.methods", "worker.engines"),
])
def test_a_package_never_imports_the_one_above_it(importer, imported):
    modules = project_modules()
    packages = packages_of(modules)
    assert {importer, imported} <= packages  # both are still packages: the rule reads them
    chain = import_chain(import_graph(modules), packages, importer, imported)
    assert chain is None, f"{importer} imports {imported}: " + " -> ".join(chain)


def test_the_package_loop_finder_finds_two_packages_that_import_each_others_modules(tmp_path):
    # The rule's own check: p.a.x imports p.b.y and p.b.z imports p.a.w (inside a function).
    # No module is in a circle, but the packages p.a and p.b loop.
    files = {"p/__init__.py": "", "p/a/__init__.py": "", "p/a/w.py": "",
             "p/a/x.py": "from p.b import y\n", "p/b/__init__.py": "", "p/b/y.py": "",
             "p/b/z.py": "def f():\n    from ..a import w\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = project_modules(tmp_path, ("p",))
    packages = packages_of(modules)
    graph = import_graph(modules)
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph, packages)) == ["p.a", "p.b", "p.a"]
    assert import_chain(graph, packages, "p.b", "p.a") == ["p.b.z", "p.a"]
    graph["p.b.z"] = set()
    assert find_cycle(package_graph(graph, packages)) is None
    assert import_chain(graph, packages, "p.b", "p.a") is None
    # through a module of neither package: p.b.y -> p.top -> p.a.w
    graph["p.b.y"], graph["p.top"] = {"p.top"}, {"p.a.w"}
    assert import_chain(graph, packages, "p.b", "p.a") == ["p.b.y", "p.top", "p.a.w"]
    assert find_cycle(package_graph(graph, packages)) == ["p.a", "p.b", "p.top", "p.a"]


def test_worker_imports_nothing_of_django_the_site_or_the_demo():
    graph_names = {name: imported_names(name, path)
                   for name, path in project_modules().items() if name.startswith("worker")}
    assert "worker.measure" in graph_names
    leaks = {name: sorted(i for i in imported
                          if i.split(".")[0] in ("django", "leaderboard", "demo"))
             for name, imported in graph_names.items()}
    assert {name: found for name, found in leaks.items() if found} == {}


def test_the_site_imports_the_demo_only_in_its_command():
    # The web and worker images hold no demo/ (docker/), and their environments no gradio: a
    # page that imported the demo would tie the site to the demo's environment.
    graph = import_graph()
    assert {m for m, deps in graph.items() if m.startswith("leaderboard")
            and any(d.split(".")[0] == "demo" for d in deps)} == {
        "leaderboard.management.commands.demo"}


def test_the_measurement_task_is_named_after_where_it_lives():
    # worker/ is the measurement library, not the Celery worker: the task's name is its
    # module's, and the name the site sends (MEASURE_RUN) resolves to it.
    from leaderboard.celery import MEASURE_RUN, app
    from leaderboard.tasks import measure_run

    task = app.tasks[MEASURE_RUN]
    assert task.run is measure_run.run
    assert MEASURE_RUN == f"{measure_run.run.__module__}.{measure_run.run.__name__}"
