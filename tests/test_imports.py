"""The import graphs, read from the source: no cycles, and arrows that point down (pipeline -> stages ->
edgeflux; the library imports none of them, nor their tools).

Every import counts, at module level and inside functions (a lazy import hides a cycle until the
function runs); only imports under ``if TYPE_CHECKING:`` are left out (they never run). Two graphs:

* the library's modules as Python runs them: importing ``a.b.c`` also runs the ``__init__`` of ``a``
  and ``a.b``, except packages the importer is itself inside (they are already being imported), and
  ``from pkg import name`` where ``pkg.name`` is a module imports that module;
* the files of edgeflux/, stages/ and pipeline/ as a reader follows them: ``import a.b`` is an edge to
  a/b.py, ``from pkg import name`` to pkg/name.py where that is a module and to pkg/__init__.py
  otherwise, even from inside pkg (a submodule that reads its own package's ``__init__``, which imports
  the submodule, is a cycle: it sees the package half-initialised).

A package whose ``__init__`` resolves its names on first use (``edgeflux.lazy.lazy_exports``, so that the
torch-free options load without torch) counts in both graphs as the import of the submodule that defines
each name asked for: that is the code that runs.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "edgeflux"
LAYERS = (REPO / "edgeflux", REPO / "stages", REPO / "pipeline")
# the pipeline's own code and tools: the library must work without them
FORBIDDEN = ("stages", "pipeline", "prefect", "dvc", "mlflow")
ALLOWED = {"edgeflux.tracking": {"mlflow"}}   # the MLflow adapter: this package and its modules


@dataclass
class ImportGraph:
    edges: dict[str, set[str]] = field(default_factory=dict)   # module -> the package's modules it runs
    named: dict[str, set[str]] = field(default_factory=dict)   # module -> every module its imports name


def module_names(root: Path) -> dict[str, Path]:
    """'edgeflux.bittrain' -> .../edgeflux/bittrain/__init__.py, 'edgeflux.config' -> .../config.py, ..."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


class _Imports(ast.NodeVisitor):
    """(module, names) for each import statement; names is None for ``import module``."""

    def __init__(self, importer: str, is_package: bool) -> None:
        self.package = importer if is_package else importer.rpartition(".")[0]
        self.found: list[tuple[str, list[str] | None]] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(alias.name, None) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            anchor = ".".join(parts[:len(parts) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        self.found.append((base, [alias.name for alias in node.names]))


def lazy_names(path: Path, package: str) -> dict[str, str]:
    """name -> the module that defines it, read from a package __init__'s `lazy_exports(__name__, {...})`."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports" and len(node.args) == 2:
            modules = ast.literal_eval(node.args[1])
            return {name: module if "." in module else f"{package}.{module}"
                    for module, names in modules.items() for name in names}
    return {}


def _lazy(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    return {name: found for name, path in modules.items() if path.name == "__init__.py"
            and (found := lazy_names(path, name))}


def _resolve(module: str, names: list[str] | None, lazy: dict[str, dict[str, str]]) -> list[tuple[str, list[str] | None]]:
    """One import statement as the imports that run: names of a lazy package come from their submodules."""
    if names is None or module not in lazy:
        return [(module, names)]
    direct = [n for n in names if n not in lazy[module]]
    return [(module, direct)] * bool(direct) + [(lazy[module][n], None) for n in names if n in lazy[module]]


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(importer: str, module: str, names: list[str] | None, known: set[str]) -> set[str]:
    """The modules whose code runs (or whose namespace is read) for one import statement."""
    submodules = {f"{module}.{n}" for n in names or () if f"{module}.{n}" in known}
    reads_module = names is None or len(submodules) < len(names)
    direct = submodules | ({module} if reads_module else set())
    implied = set(_parents(module)) | ({module} if not reads_module else set())
    inside = set(_parents(importer)) | {importer}
    return (direct | (implied - inside)) - {importer}


def _imports_of(name: str, path: Path) -> list[tuple[str, list[str] | None]]:
    finder = _Imports(name, path.name == "__init__.py")
    finder.visit(ast.parse(path.read_text(), filename=str(path)))
    return finder.found


def import_graph(root: Path = PACKAGE) -> ImportGraph:
    modules = module_names(root)
    known, lazy = set(modules), _lazy(modules)
    graph = ImportGraph()
    for name, path in modules.items():
        found = [r for m, names in _imports_of(name, path) for r in _resolve(m, names, lazy)]
        graph.edges[name] = set().union(*(_targets(name, m, names, known) for m, names in found)) & known
        graph.named[name] = {m for m, _ in found}
    return graph


def _file_targets(module: str, names: list[str] | None, known: set[str]) -> set[str]:
    """The files one import statement names: the module, or for each name its submodule if it is one."""
    if names is None:
        return {module} & known
    return {f"{module}.{n}" if f"{module}.{n}" in known else module for n in names} & known


def file_graph(roots: tuple[Path, ...] = LAYERS) -> dict[str, set[str]]:
    """module -> the modules whose files its imports name (see the module docstring)."""
    modules = {name: path for root in roots for name, path in module_names(root).items()}
    known, lazy = set(modules), _lazy(modules)
    return {name: set().union(*(_file_targets(r, names, known) for m, n in _imports_of(name, path)
                                for r, names in _resolve(m, n, lazy))) - {name}
            for name, path in modules.items()}


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per edge back into the depth-first path, each as [a, b, ..., a], deduplicated."""
    cycles: dict[frozenset, list[str]] = {}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt):] + [nxt]
                cycles.setdefault(frozenset(zip(cycle, cycle[1:])), cycle)
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for start in sorted(edges):
        if start not in done:
            visit(start, [start])
    return list(cycles.values())


def _allowed(importer: str, allowed: dict[str, set[str]]) -> set[str]:
    return set().union(*(tools for package, tools in allowed.items()
                         if importer == package or importer.startswith(package + ".")))


def forbidden_imports(graph: ImportGraph, forbidden: tuple[str, ...] = FORBIDDEN,
                      allowed: dict[str, set[str]] = ALLOWED) -> list[str]:
    found = []
    for importer, targets in sorted(graph.named.items()):
        for target in sorted(targets):
            top = target.partition(".")[0]
            if top in forbidden and top not in _allowed(importer, allowed):
                found.append(f"{importer} imports {target}")
    return found


def _as_files(cycle: list[str]) -> str:
    paths = {name: path for root in LAYERS for name, path in module_names(root).items()}
    return " -> ".join(str(paths[name].relative_to(REPO)) if name in paths else name for name in cycle)


def test_library_has_no_import_cycles():
    cycles = find_cycles(import_graph().edges)
    assert not cycles, "import cycles in edgeflux (move what both sides need into a module of its own):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_between_files():
    cycles = find_cycles(file_graph())
    assert not cycles, "import cycles between files of edgeflux/, stages/ and pipeline/ (move what both sides " \
        "need into a module below both; import a name from the submodule that defines it, not from its " \
        "package's __init__):\n" + "\n".join(_as_files(c) for c in cycles)


def test_library_does_not_import_the_pipeline():
    found = forbidden_imports(import_graph())
    assert not found, f"library modules import pipeline code or tools ({', '.join(FORBIDDEN)}); only " \
                      f"edgeflux.tracking may import mlflow:\n" + "\n".join(found)


def test_stages_do_not_import_the_pipeline():
    found = forbidden_imports(import_graph(REPO / "stages"), forbidden=("pipeline",), allowed={})
    assert not found, "stages import pipeline code (the arrows point down: pipeline -> stages -> edgeflux; " \
                      "move what both need into edgeflux):\n" + "\n".join(found)


def test_the_walk_sees_lazy_package_and_submodule_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.sub import c\n",                  # lazy; runs pkg.sub's __init__
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        "sub/__init__.py": "from . import c\n",
        "sub/c.py": "from .. import a\nimport pkg.sub.d\nimport prefect.flows\n",
        "sub/d.py": "from pkg.sub import c\n",             # c is a module, and d is inside pkg.sub already
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph.edges["pkg.a"] == {"pkg.sub", "pkg.sub.c"}
    assert graph.edges["pkg.b"] == set()
    assert graph.edges["pkg.sub.c"] == {"pkg.a", "pkg.sub.d"}
    assert graph.edges["pkg.sub.d"] == {"pkg.sub.c"}
    assert sorted(" -> ".join(c) for c in find_cycles(graph.edges)) == [
        "pkg.a -> pkg.sub -> pkg.sub.c -> pkg.a", "pkg.sub.c -> pkg.sub.d -> pkg.sub.c"]
    assert forbidden_imports(graph) == ["pkg.sub.c imports prefect.flows"]


def test_the_file_graph_counts_a_package_init_and_submodules(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__.py": "from pkg.a import f\n",
        "a.py": "from pkg import b\nfrom pkg import g\n",                 # b: a module; g: a name of __init__
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n",
        "c.py": "import pkg.b\ndef h():\n    from . import a\n",      # lazy and relative still count
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    edges = file_graph((pkg,))
    assert edges == {"pkg": {"pkg.a"}, "pkg.a": {"pkg", "pkg.b"}, "pkg.b": set(), "pkg.c": {"pkg.a", "pkg.b"}}
    assert find_cycles(edges) == [["pkg", "pkg.a", "pkg"]]


def test_a_lazy_package_counts_as_the_submodules_it_hands_out(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__.py": 'from edgeflux.lazy import lazy_exports\n'
                       '__getattr__, __dir__, __all__ = lazy_exports(__name__, {"heavy": ["f"], "light": ["g"]})\n',
        "heavy.py": "def f(): ...\n",
        "light.py": "from pkg import f\n",       # runs heavy, which imports light back: a cycle through the package
        "user.py": "from pkg import g\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    (pkg / "heavy.py").write_text("import pkg.light\ndef f(): ...\n")
    graph = import_graph(pkg)
    assert graph.edges["pkg.user"] == {"pkg.light"} and "pkg.heavy" in graph.edges["pkg.light"]
    assert find_cycles(graph.edges) == [["pkg.heavy", "pkg.light", "pkg.heavy"]]
    assert find_cycles(file_graph((pkg,))) == [["pkg.heavy", "pkg.light", "pkg.heavy"]]
