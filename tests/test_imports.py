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


# The house's plan (README, "The map"): the engine a learner reads stands at labkit's top; the
# tools around it live in wings; kernels and utilities sit below everything.
WINGS = ("labkit.bench", "labkit.serving", "labkit.instruments", "labkit.graders")
BELOW = ("labkit.kernels", "labkit.utils")
CLI_ENTRY = {"labkit.__main__"}  # dispatches to every command, wings included


def in_package(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def at_top(name: str) -> bool:
    return name == "labkit" or (name.count(".") == 1 and not MODULES[name].name == "__init__.py")


def wing_imports_at_top(modules: dict[str, set[str]]) -> list[str]:
    """'top -> wing' for each import from a top-level module (not the CLI entry) into a wing."""
    return [f"{name} -> {dep}" for name, deps in sorted(modules.items())
            if at_top(name) and name not in CLI_ENTRY
            for dep in sorted(deps) if in_package(dep, WINGS)]


def test_nothing_at_the_top_imports_a_wing():
    graph = {name: imports_of(path) for name, path in MODULES.items()}
    bad = wing_imports_at_top(graph)
    assert not bad, (
        "the engine at labkit's top imports a wing: " + ", ".join(bad) + ". The benchmarks, "
        "the server, the instruments and the graders use the engine; the engine never uses "
        "them (README, 'The map'). Move what the engine needs down to the top, or the caller up")


def test_the_checker_sees_a_top_module_importing_a_wing():
    """The rule itself: a made-up top module that imports the server is caught; the same
    import from the CLI entry or from another wing is allowed."""
    fake = {n: {"labkit.serving.server"}
            for n in ("labkit.engine", "labkit.__main__", "labkit.bench.decode")}
    assert wing_imports_at_top(fake) == ["labkit.engine -> labkit.serving.server"]


def test_kernels_and_utilities_import_nothing_above_them():
    bad = [f"{name} -> {dep}" for name, path in sorted(MODULES.items())
           if in_package(name, BELOW)
           for dep in sorted(imports_of(path)) if not in_package(dep, BELOW)]
    assert not bad, ("labkit.kernels and labkit.utils stand under the engine and import only "
                     "each other: " + ", ".join(bad))


def test_the_top_holds_the_engine_and_little_else():
    top = sorted(n for n in MODULES if at_top(n) and n != "labkit")
    assert len(top) <= 32, (
        f"{len(top)} modules at labkit's top ({', '.join(top)}): the engine a learner opens "
        "stands there; a tool around it belongs in a wing (bench, serving, instruments, "
        "graders)")
    for name in ("labkit.decode_blocking", "labkit.decode_pipelined", "labkit.roofline"):
        assert name in top, f"{name} must stay at labkit's top (the design card names it)"


def test_the_kernels_are_source_files():
    kernels = PACKAGE / "kernels"
    assert (kernels / "paged_attention.cpp").exists() and (kernels / "lanes.h").exists()
    for path in PACKAGE.rglob("*.py"):  # no C++ hidden in a Python string
        text = path.read_text()
        assert "#include <" not in text, (
            f"{path} holds C++ source in a string: kernels live in labkit/kernels/*.cpp")
