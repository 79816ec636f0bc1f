"""The import structure: every module is placed in a layer, no module imports a layer above its
own, and no import cycle anywhere.

Layers, bottom to top (LAYERS): each names packages, whose modules (at any depth) are all in it,
and single modules. The two roots, `distlaunch.launcher` and the package root `distlaunch`, hold
modules of different layers, so their own modules are each listed: a module added there, or in a
package no layer names, is unplaced and fails the test. Every import statement counts, also one
inside a function or under TYPE_CHECKING: a lazy import is still a dependency.
`distlaunch.worker` is below everything and imports no launcher code; `distlaunch.host` (what runs
on a task's host) is next, and imports no launcher code either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {
    "distlaunch": REPO / "launcher" / "root",  # the package root, kept inside launcher/
    "distlaunch.launcher": REPO / "launcher",
    "distlaunch.worker": REPO / "worker",
    "distlaunch.host": REPO
    / "launcher"
    / "host",  # what runs on a task's host, kept inside launcher/
}
# Packages whose modules are not placed by the package's name: each is listed.
ROOTS = ("distlaunch", "distlaunch.launcher")

LAYERS = (
    (  # the runtime a training script imports
        "worker",
        ("distlaunch.worker",),
    ),
    (  # what runs on a task's host beside the program: the agent, keepers, guard, bootstrap
        "host",
        ("distlaunch.host",),
    ),
    (  # what every layer uses; the launcher's root package is a docstring
        "core",
        (
            "distlaunch.launcher",
            "distlaunch.launcher.core",
        ),
    ),
    (  # the cluster spec
        "spec",
        ("distlaunch.launcher.spec",),
    ),
    (  # pure decisions made from the spec
        "plan",
        ("distlaunch.launcher.plan",),
    ),
    (  # the run dir and run.json
        "record",
        ("distlaunch.launcher.record",),
    ),
    (  # why a run failed or stalls
        "diagnosis",
        ("distlaunch.launcher.diagnosis",),
    ),
    (  # netns and the remote hosts' firewall
        "network",
        ("distlaunch.launcher.network",),
    ),
    (  # starting, watching and stopping tasks
        "transports",
        ("distlaunch.launcher.transports",),
    ),
    (  # Kubernetes manifests
        "export",
        ("distlaunch.launcher.export",),
    ),
    (  # commands on a run from another shell
        "control",
        ("distlaunch.launcher.control",),
    ),
    (  # a run told as a picture: report.html
        "report",
        ("distlaunch.launcher.report",),
    ),
    (  # up, the supervisor and its policy
        "run",
        ("distlaunch.launcher.run",),
    ),
    (  # the command line
        "cli",
        (
            "distlaunch.launcher.cli",
            "distlaunch.launcher.__main__",
        ),
    ),
    (  # the Python API, the package root, the pytest plugin
        "api",
        (
            "distlaunch.launcher.api",
            "distlaunch",
            "distlaunch.pytest_plugin",
        ),
    ),
)


class Unplaced(Exception):
    """A module that no layer places."""


def layer_of(module: str) -> str:
    """The layer of ``module``: the one naming it or, outside the roots, a package above it."""
    for layer, members in LAYERS:
        for member in members:
            if module == member or (member not in ROOTS and module.startswith(member + ".")):
                return layer
    raise Unplaced(module)


def unplaced(modules) -> list[str]:
    """The modules of ``modules`` that no layer places."""
    out = []
    for module in modules:
        try:
            layer_of(module)
        except Unplaced:
            out.append(module)
    return out


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if package == "distlaunch.launcher" and any(
                PACKAGES[other] in path.parents for other in ("distlaunch", "distlaunch.host")
            ):
                continue  # launcher/root and launcher/host are packages of their own
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The distlaunch modules ``name`` imports (a package import counts as its __init__)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).rstrip(".")
            # `from pkg import mod` imports pkg.mod when it is a module, else a name of pkg.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _rank(module: str) -> int:
    return [layer for layer, _ in LAYERS].index(layer_of(module))


def test_every_module_is_placed() -> None:
    missing = unplaced(MODULES)
    assert not missing, f"no layer places {', '.join(missing)}: add each to LAYERS in {__file__}"


def test_a_module_no_layer_names_is_unplaced() -> None:
    # A new module at a root, or in a package no layer names, is never placed by a prefix.
    new = [f"{root}.brand_new" for root in ROOTS] + [f"{ROOTS[1]}.brand_new_pkg.mod"]
    assert unplaced([*MODULES, *new]) == new


def test_no_module_imports_a_layer_above_its_own() -> None:
    placed = set(MODULES) - set(unplaced(MODULES))  # the unplaced fail the test above
    wrong = [
        f"{name} ({layer_of(name)}) imports {dep} ({layer_of(dep)})"
        for name, deps in GRAPH.items()
        for dep in sorted(deps & placed)
        if name in placed and _rank(dep) > _rank(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_supervisor_knows_transports_only_through_their_interface() -> None:
    transports = {
        d for d in GRAPH["distlaunch.launcher.run.supervisor"] if layer_of(d) == "transports"
    }
    assert transports == {"distlaunch.launcher.transports.base"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes, the first repeated at the end), or None."""
    # Depth-first search; a back edge to a node on the current path is a cycle.
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


def package_of(module: str) -> str:
    """The package ``module`` is in (a package is its own); a root's module stands for itself."""
    if MODULES[module].name == "__init__.py":
        return module
    parent = module.rsplit(".", 1)[0]
    return module if parent in ROOTS else parent


def test_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_packages() -> None:
    # Modules of one package may import each other; packages (a backend's package and the
    # others in transports/ too) form no cycle, so each package can be read from below.
    graph: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        graph.setdefault(package_of(name), set()).update(
            package_of(d) for d in deps if package_of(d) != package_of(name)
        )
    cycle = find_cycle(graph)
    assert not cycle, "import cycle between packages: " + " -> ".join(cycle)


def test_a_cycle_is_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_layer_table_names_real_modules() -> None:
    # A renamed module must not leave a stale entry behind (it would place nothing).
    stale = [m for _, members in LAYERS for m in members if m not in MODULES]
    assert not stale, stale
