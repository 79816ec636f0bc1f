"""The import structure: no module imports a layer above its own, and no import cycle anywhere.

Layers, bottom to top: spec -> plan -> transports -> supervisor -> up -> cli -> api (the Python
API and the package root `distlaunch`, a front end over the same layers as the command line). Every import
statement counts, also one inside a function or under TYPE_CHECKING: a lazy import is still a
dependency. `distlaunch.worker` is below everything and imports no launcher code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {
    "distlaunch": REPO / "launcher" / "root",  # the package root, kept inside launcher/
    "distlaunch.launcher": REPO / "launcher",
    "distlaunch.worker": REPO / "worker",
}

# Each launcher module's layer. A new module must be placed here (the test says so).
LAYERS = ("worker", "spec", "plan", "transports", "supervisor", "up", "cli", "api")
LAYER_OF = {
    # spec: what the spec is, and what every layer uses (errors, the run dir, the terminal)
    "distlaunch.launcher": "spec",
    "distlaunch.launcher.errors": "spec",
    "distlaunch.launcher.spec": "spec",
    "distlaunch.launcher.spec_sources": "spec",
    "distlaunch.launcher.records": "spec",  # the typed records the spec is made of
    "distlaunch.launcher.rundir": "spec",
    "distlaunch.launcher.console": "spec",
    "distlaunch.launcher.summary": "spec",
    "distlaunch.launcher.endings": "spec",  # the kinds of a task's or a run's ending
    "distlaunch.launcher.tfconfig": "spec",
    "distlaunch.launcher.evidence": "spec",
    "distlaunch.launcher.hints": "spec",
    "distlaunch.launcher.api_types": "spec",  # the API's results and errors: plain data
    "distlaunch.launcher.api_protocol": "spec",  # the API's caller <-> launcher process lines
    "distlaunch.launcher.backends": "spec",  # the registry: every backend's name, none imported
    # run.json: a backend class reads its own section of it, so it sits below the transports
    "distlaunch.launcher.state": "spec",
    # plan: pure decisions made from the spec
    "distlaunch.launcher.plan": "plan",
    "distlaunch.launcher.placement": "plan",  # where each task runs, decided once per backend
    "distlaunch.launcher.ports": "plan",
    "distlaunch.launcher.isolation": "plan",
    "distlaunch.launcher.policy": "plan",
    "distlaunch.launcher.program_scan": "plan",
    "distlaunch.launcher.program_env": "plan",  # the env a program sets before TensorFlow
    # transports: starting, watching and stopping tasks
    "distlaunch.launcher.procs": "transports",
    "distlaunch.launcher.transports": "transports",
    "distlaunch.launcher.k8s": "transports",  # Kubernetes manifests, like compose_file
    "distlaunch.launcher.taskinit": "transports",  # the init a local task starts through
    "distlaunch.launcher.standby": "transports",  # warm standbys of local tasks
    "distlaunch.launcher.firewall": "transports",  # the SSH hosts' per-run guards
    "distlaunch.launcher.heartbeat": "transports",  # the pulse to remote helpers and guards
    "distlaunch.launcher.transports.helper": "transports",  # the helper-over-stdin transport
    # supervisor: the loop and the run's state
    "distlaunch.launcher.supervisor": "supervisor",
    "distlaunch.launcher.progress_view": "supervisor",  # the live line and status --watch
    "distlaunch.launcher.formation": "supervisor",  # whether the cluster formed, from its log
    # up and the commands that inspect or steer a run from another shell
    "distlaunch.launcher.up": "up",
    "distlaunch.launcher.control": "up",
    # the command line
    "distlaunch.launcher.cli": "cli",
    "distlaunch.launcher.__main__": "cli",
    "distlaunch.launcher.api_child": "cli",  # the launcher process of a run started from Python
    # the Python API: launch/up/run, the package root, the pytest plugin
    "distlaunch.launcher.api": "api",
    "distlaunch.launcher.api_call": "api",
    "distlaunch.launcher.api_reads": "api",
    "distlaunch.launcher.api_pool": "api",  # the warm clusters of `distlaunch.run`
    "distlaunch": "api",  # the root's own modules are each listed: it is no prefix
    "distlaunch.pytest_plugin": "api",
}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if package == "distlaunch.launcher" and PACKAGES["distlaunch"] in path.parents:
                continue  # launcher/root is the package `distlaunch`, not a launcher module
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


def _layer(module: str) -> str:
    if module.startswith("distlaunch.worker"):
        return "worker"
    if module in LAYER_OF:
        return LAYER_OF[module]
    for prefix in sorted(LAYER_OF, key=len, reverse=True):
        if prefix == "distlaunch":
            continue
        if module == prefix or module.startswith(prefix + "."):
            return LAYER_OF[prefix]
    pytest.fail(f"{module} has no layer: add it to LAYER_OF in {__file__}")


def test_no_module_imports_a_layer_above_its_own() -> None:
    wrong = [
        f"{name} ({_layer(name)}) imports {dep} ({_layer(dep)})"
        for name, deps in GRAPH.items()
        for dep in sorted(deps)
        if LAYERS.index(_layer(dep)) > LAYERS.index(_layer(name))
    ]
    assert not wrong, "\n".join(wrong)


def test_the_supervisor_knows_transports_only_through_their_interface() -> None:
    transports = {d for d in GRAPH["distlaunch.launcher.supervisor"] if _layer(d) == "transports"}
    assert transports == {"distlaunch.launcher.transports.base"}


def test_no_import_cycle() -> None:
    # Depth-first search; a back edge to a module on the current path is a cycle.
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_the_layer_table_names_real_modules() -> None:
    # A renamed module must not leave a stale entry behind (it would place nothing).
    assert all(any(m == p or m.startswith(p + ".") for m in MODULES) for p in LAYER_OF)
