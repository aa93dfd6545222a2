"""The house rule of ../shared/DESIGN.md: imports inside labkit flow one way (no circles).

Every `import` of a labkit module counts: at a module's top, inside a function (a lazy import
is still a dependency) and under `if TYPE_CHECKING:` (a reader follows it just the same).
"""

import ast
import pathlib

import labkit

PACKAGE = pathlib.Path(labkit.__file__).parent
# every module of the package, subpackages (labkit.graders) included: labkit.graders.common
MODULES = {".".join(("labkit", *p.relative_to(PACKAGE).with_suffix("").parts)
                    ).removesuffix(".__init__"): p
           for p in PACKAGE.rglob("*.py")}


def imports_of(path: pathlib.Path) -> set[str]:
    """The labkit modules a file imports, anywhere in it."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "labkit")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "labkit":  # `from labkit.x import y`: y may be
                # a submodule (labkit.x.y) or a name defined in labkit.x
                found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                             else node.module for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_finder_sees_a_circle_and_a_lazy_import():
    """The checker itself: a two-module circle closed by an import inside a function, and
    an import for type checkers only, which counts too."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import labkit.engine\n" \
          "def f():\n    from labkit.model import LlamaModel\n"
    tmp = PACKAGE.parent / "tests" / "_imports_probe.py"
    try:
        tmp.write_text(src)
        assert imports_of(tmp) == {"labkit.engine", "labkit.model"}
    finally:
        tmp.unlink()


def test_no_import_circle_inside_labkit():
    graph = {name: imports_of(path) - {name} for name, path in MODULES.items()}
    cycle = find_cycle(graph)
    assert cycle is None, (
        "labkit's imports form a circle: " + " -> ".join(cycle) + ". DESIGN.md: imports flow "
        "one way. Move what both sides need into the lower module, or choose the variant in "
        "the layer above both")
