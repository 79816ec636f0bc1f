"""The cluster spec: a typed, validated, frozen model of the JSON or YAML file a user writes.

`load_spec` is the one way in: it reads the file (spec/files.py), applies `--set` overrides
(spec/sources.py), checks the data against the spec's JSON Schema (spec/schema.py, compiled into
spec/checker.py: what `distlaunch schema` publishes is what is checked), spreads host files and
`per_host` (spec/hosts.py, bounded before anything is built), builds the typed model and checks
what no schema can state (spec/checks.py): the sum of all tasks, ports and GPUs shared between
tasks, hosts a task names, files that must exist. Every problem becomes a `SpecError` naming the
file, the JSON path and what was expected, so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distlaunch.launcher.core import backends
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec import checks, files, schema, typed
from distlaunch.launcher.spec.checks import refuse_elastic, task_json_path
from distlaunch.launcher.spec.hosts import expand
from distlaunch.launcher.spec.rules import (
    IMAGE_REF,
    K8S_LABEL,
    LOCAL_HOSTS,
    MAX_CPUS,
    MAX_GPUS,
    MAX_TASKS,
    OWNED_SSH_OPTIONS,
)
from distlaunch.launcher.spec.sources import Source, SpecOptions, apply_overrides
from distlaunch.launcher.spec.typed import (
    RESERVED_ENV,
    Cpus,
    Elastic,
    Gpus,
    Host,
    Kubernetes,
    Program,
    Restart,
    Spec,
    TaskEntry,
    Tasks,
    Timeouts,
)

# What the rest of the launcher imports from here: the spec's types, limits and the loader.
__all__ = [
    "IMAGE_REF",
    "K8S_LABEL",
    "LOCAL_HOSTS",
    "MAX_CPUS",
    "MAX_GPUS",
    "MAX_TASKS",
    "OWNED_SSH_OPTIONS",
    "RESERVED_ENV",
    "Cpus",
    "Elastic",
    "Gpus",
    "Host",
    "Kubernetes",
    "LoadedSpec",
    "Program",
    "Restart",
    "Spec",
    "TaskEntry",
    "Tasks",
    "Timeouts",
    "json_schema",
    "load_spec",
    "load_spec_data",
    "refuse_elastic",
    "task_json_path",
]


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec plus where it came from, with every path made absolute."""

    spec: Spec
    file: Path
    raw: dict[str, Any]
    shared_dir: Path
    workdir: Path
    script: Path | None
    # The spec's hosts with identity files made absolute (relative ones are relative to the spec).
    hosts: Mapping[str, Host] = field(default_factory=dict)
    # What errors call the spec: the path given (or "<spec>", the Python API's spec as data).
    shown: str = ""

    def address_of(self, host: str) -> str:
        """The address of the host a task names: what TF_CONFIG lists (127.0.0.1 for localhost)."""
        return checks.machine(self.spec, host)

    def ssh_host(self, name: str) -> Host | None:
        """The SSH host called ``name``; None when tasks on ``name`` run on this machine."""
        host = self.hosts.get(name)
        return host if host is not None and host.transport == "ssh" else None


def json_schema() -> dict[str, Any]:
    """Return the JSON Schema of the cluster spec file, as users write it: the document the
    validator is compiled from, with the installed backends' names."""
    return schema.published(backends.names())


def load_spec(path: str | Path, options: SpecOptions = SpecOptions()) -> LoadedSpec:
    """Read, validate and resolve the spec at ``path`` (JSON, or YAML 1.2 for .yaml/.yml) with
    the command line's ``options`` applied first; raise SpecError on any problem."""
    file = Path(path)
    shown = str(path)
    source = files.read(file, shown)
    return _load(source, file.resolve().parent, file, shown, options)


def load_spec_data(
    raw: Mapping[str, Any], base: Path, shown: str, options: SpecOptions = SpecOptions()
) -> LoadedSpec:
    """Validate and resolve a spec given as data (the Python API's dict), relative paths against
    ``base``; errors name ``shown`` where a file's would name the file. ``raw`` is not changed."""
    if not isinstance(raw, Mapping):
        raise SpecError(shown, "$", f"expected a mapping, got {type(raw).__name__}")
    source = Source(raw=copy.deepcopy(dict(raw)), file=shown)
    return _load(source, base.resolve(), base / shown, shown, options)


def _load(source: Source, base: Path, file: Path, shown: str, options: SpecOptions) -> LoadedSpec:
    try:
        apply_overrides(source, options.overrides, shown)
        typed.check_schema(source.raw, shown)
        written = copy.deepcopy(source.raw)
        expand(source, base, shown, options)
        spec = Spec.of(source.raw, written)
        checks.check_spec(spec, shown, source.raw)
        paths = checks.resolve_paths(spec, file, shown, source.raw)
    except SpecError as exc:
        raise source.locate(exc) from None
    return LoadedSpec(
        spec=spec,
        file=file,
        raw=source.raw,
        shared_dir=paths.shared_dir,
        workdir=paths.workdir,
        script=paths.script,
        hosts=paths.hosts,
        shown=shown,
    )
