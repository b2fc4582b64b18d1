"""The shape of the code: no import cycle between the modules of src/ and train.py; test modules that import no other
test module."""

import ast
import re
from pathlib import Path

from tests.conftest import REPO
from tests.helpers import imported_names


def module_files() -> dict[str, Path]:
    files = {"train": REPO / "train.py"}
    for path in (REPO / "src").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """Every module of ours that `path` imports when it runs: at the top or inside a function (where a cycle would
    hide), not under `if TYPE_CHECKING:`. Importing a.b also runs package a's __init__."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    }
    inside = {id(child) for node in ast.walk(tree) if id(node) in skipped for child in ast.walk(node)}
    found = imported_names(node for node in ast.walk(tree) if id(node) not in inside)
    ours = set()
    for name in found:
        parts = name.split(".")
        ours |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules
    return ours


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imports = runtime_imports(path, set(files))
        # a module's own enclosing packages are already being imported when it runs: not an edge
        graph[name] = {t for t in imports if t != name and not (package + ".").startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_src_and_train_py():
    graph = import_graph()
    assert graph["src.cli"] >= {"src.config", "src.tasks"}  # the graph sees real imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_core_imports_no_feature():
    """train.py and the core's modules never import a feature (src/features/<name>), so deleting one leaves them
    working; only src/features/__init__.py finds the features, by looking."""
    graph = import_graph()
    if "src.features.object_storage" in graph:  # the graph sees features
        assert graph["src.features.object_storage"] & {"src.features.object_storage.mirror"}
    core = {name: imports for name, imports in graph.items() if not name.startswith("src.features.")}
    reaching = {name: sorted(i for i in imports if i.startswith("src.features.")) for name, imports in core.items()}
    assert {name: found for name, found in reaching.items() if found} == {}


def test_the_cycle_finder_finds_a_function_local_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    graph = {name: runtime_imports(tmp_path / f"{name}.py", {"a", "b"}) - {name} for name in ("a", "b")}
    assert find_cycle(graph) == ["a", "b", "a"]


def imported_test_modules(path: Path) -> set[str]:
    """The tests.test_* modules that the file at `path` imports, anywhere in it (a function's import too)."""
    found = imported_names(ast.walk(ast.parse(path.read_text())))
    return {name for name in found if re.match(r"(tests\.)?test_\w+$", name)}


def test_no_test_module_imports_another():
    """Shared helpers live in tests/helpers.py or tests/conftest.py: a feature's test file deleted with the feature
    takes nothing from the tests that stay."""
    imports = {path.name: imported_test_modules(path) for path in sorted((REPO / "tests").glob("*.py"))}
    assert {name: found for name, found in imports.items() if found} == {}


def test_the_test_import_check_sees_every_form(tmp_path):
    module = tmp_path / "test_a.py"
    # a made-up module's lines; the package named apart, so that a text scan of this file (or of its compiled form)
    # finds no test-module import in it
    package = "tests"
    lines = ["import os", f"from {package}.helpers import x", f"from {package} import test_b", "def f():",
             f"    from {package}.test_c import y", "    import test_d"]  # fmt: skip
    module.write_text("\n".join(lines) + "\n")
    assert imported_test_modules(module) == {"tests.test_b", "tests.test_c", "test_d"}


def test_every_module_is_on_the_map():
    """docs/how_it_works.md's repository layout names every module of src/ (one job each, one line each)."""
    layout = (REPO / "docs" / "how_it_works.md").read_text()
    modules = [p.relative_to(REPO).as_posix() for p in (REPO / "src").glob("*.py") if p.name != "__init__.py"]
    assert [m for m in modules if m not in layout] == []
