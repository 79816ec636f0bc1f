"""The cluster spec: a typed, validated, frozen model of the JSON or YAML file a user writes.

`load_spec` is the one way in: it reads the file, applies `--set` overrides, checks the data
against the spec's JSON Schema (spec/schema.py, compiled into spec/checker.py: what `distlaunch
schema` publishes is what is checked), spreads host files and `per_host` (bounded before
anything is built), builds the typed model and checks what no schema can state: the sum of all
tasks, ports and GPUs shared between tasks, hosts a task names, files that must exist. Every
problem becomes a `SpecError` naming the file, the JSON path and what was expected, so the CLI can
print one line and exit 2.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from distlaunch.launcher.core import backends
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec import checker, schema
from distlaunch.launcher.spec.invalid import Invalid, json_path, short_path, shown, spec_error
from distlaunch.launcher.spec.schema import (
    IMAGE_REF,
    K8S_LABEL,
    LOCAL_HOSTS,
    MAX_CPUS,
    MAX_GPUS,
    MAX_TASKS,
    OWNED_SSH_OPTIONS,
)
from distlaunch.launcher.spec.sources import (
    MAX_INT_DIGITS,
    Source,
    SpecOptions,
    apply_overrides,
    expand,
    huge_int_message,
    preview,
    read_yaml,
)
from distlaunch.worker import contract

__all__ = [
    "IMAGE_REF",
    "K8S_LABEL",
    "LOCAL_HOSTS",
    "MAX_CPUS",
    "MAX_GPUS",
    "MAX_TASKS",
    "OWNED_SSH_OPTIONS",
]

ROLES = (contract.CHIEF, contract.WORKER, contract.PS, contract.EVALUATOR)
# Environment names the launcher owns; a spec may not set them.
RESERVED_ENV = re.compile(schema.RESERVED_ENV)

# A task's GPUs: a count, a tuple of indices, or None (CPU only).
Gpus = int | tuple[int, ...] | None
# A task's CPUs: a count, a tuple of CPU ids, "all" (no pinning) or "auto".
Cpus = int | tuple[int, ...] | str


def _int(value: Any) -> int:
    """A valid integer (JSON Schema counts 2.0 as the integer 2)."""
    return int(value)


def _ints(value: Any) -> Any:
    """A count or a list of indices as the model holds them (a list becomes a tuple)."""
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return value if value is None or isinstance(value, str) else int(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class TaskEntry:
    """One task of a role: where it runs and what it gets."""

    host: str = "localhost"
    port: int | str = "auto"
    gpus: Gpus = None
    cpus: Cpus = "auto"

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> TaskEntry:
        """A task from valid data."""
        port = data.get("port", "auto")
        return cls(
            host=data.get("host", "localhost"),
            port=port if isinstance(port, str) else _int(port),
            gpus=_ints(data.get("gpus")),
            cpus=_ints(data.get("cpus", "auto")),
        )


@dataclass(frozen=True)
class Tasks:
    """Tasks by role, as TensorFlow names them in TF_CONFIG (None: no such role)."""

    chief: tuple[TaskEntry, ...] | None = None
    worker: tuple[TaskEntry, ...] | None = None
    ps: tuple[TaskEntry, ...] | None = None
    evaluator: tuple[TaskEntry, ...] | None = None

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Tasks:
        """The roles from valid data whose `per_host` roles are spread already (a count of
        at most MAX_TASKS: the schema bounds it)."""
        roles: dict[str, tuple[TaskEntry, ...]] = {}
        for role in ROLES:
            group = data.get(role)
            if isinstance(group, list):
                roles[role] = tuple(TaskEntry.of(entry) for entry in group)
            elif isinstance(group, dict):
                shared = TaskEntry.of(group)
                roles[role] = (shared,) * _int(group.get("count", 1))
        return cls(**roles)

    def by_role(self) -> dict[str, list[TaskEntry]]:
        """Return the roles that have tasks, in TF_CONFIG order, with their entries."""
        return {role: list(group) for role in ROLES if (group := getattr(self, role)) is not None}


@dataclass(frozen=True)
class Program:
    """What every task runs: a script or a module, with args, env and working dir."""

    script: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    python: str | None = None
    keras: Literal["auto", "keras3", "tf_keras"] = "auto"

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Program:
        """The program from valid data."""
        return cls(
            **{**data, "args": tuple(data.get("args", ())), "env": dict(data.get("env", {}))}
        )


@dataclass(frozen=True)
class Host:
    """A machine tasks are placed on by name: this one (`local`) or one reached over SSH."""

    transport: Literal["local", "ssh"] = "ssh"
    address: str | None = None
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    ssh_options: tuple[str, ...] = ()
    python: str = "python3"
    workdir: str | None = None
    host_key_checking: Literal["yes", "accept-new"] = "yes"
    connect_timeout_s: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "ssh_options", tuple(self.ssh_options))

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Host:
        """The host from valid data."""
        port = data.get("port")
        values = {**data, "port": None if port is None else _int(port)}
        if "connect_timeout_s" in data:
            values["connect_timeout_s"] = _int(data["connect_timeout_s"])
        return cls(**values)

    @classmethod
    def model_validate(cls, data: Any) -> Host:
        """A host from data checked against the schema's host (as run.json records one)."""
        try:
            checker.validate____defs_host(data, {}, "data")
        except Invalid as exc:
            raise spec_error("<host>", data, exc) from None
        return cls.of(data)

    def model_dump(self, mode: str = "json") -> dict[str, Any]:
        """The host as JSON data (what `model_validate` reads back)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def address_of(self, name: str) -> str:
        """The address tasks and ssh use for this host, called ``name`` in the spec."""
        return self.address or ("127.0.0.1" if self.transport == "local" else name)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Timeouts:
    """How long the launcher waits before it calls something failed (seconds)."""

    startup_s: float = 300.0
    grace_s: float = 5.0
    save_s: float = 30.0
    run_s: float | None = None
    heartbeat_s: float | None = None
    silence_s: float | None = None
    formation_s: float = 60.0
    evaluator_drain_s: float = 60.0

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Timeouts:
        """The timeouts from valid data."""
        return cls(**{key: _float(value) for key, value in data.items()})


@dataclass(frozen=True)
class Backoff:
    """Delay before an automatic restart: initial_s, doubled per recent restart, at most max_s."""

    initial_s: float = 1.0
    max_s: float = 30.0


@dataclass(frozen=True)
class Restart:
    """When failed tasks are started again, and how often."""

    policy: Literal["never", "on-failure"] = "never"
    max_restarts: int = 3
    backoff: Backoff = field(default_factory=Backoff)
    window_s: float | None = None
    non_retryable_exit_codes: tuple[int, ...] = (2,)
    standby: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "non_retryable_exit_codes", tuple(self.non_retryable_exit_codes))
        if isinstance(self.backoff, Mapping):  # written as the spec writes it
            object.__setattr__(self, "backoff", Backoff(**self.backoff))

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Restart:
        """The restart policy from valid data."""
        values = dict(data)
        if "max_restarts" in data:
            values["max_restarts"] = _int(data["max_restarts"])
        if "backoff" in data:
            values["backoff"] = {k: float(v) for k, v in data["backoff"].items()}
        if "window_s" in data:
            values["window_s"] = _float(data["window_s"])
        if "non_retryable_exit_codes" in data:
            values["non_retryable_exit_codes"] = _ints(data["non_retryable_exit_codes"])
        return cls(**values)

    def final_exit_codes(self) -> tuple[int, ...]:
        """The non-retryable exit codes a process can exit with (1-255), sorted, once each: what
        an engine that restarts by itself (compose, Kubernetes) is told never to retry."""
        return tuple(sorted({c for c in self.non_retryable_exit_codes if 0 < c < 256}))


@dataclass(frozen=True)
class Kubernetes:
    """What `distlaunch k8s` writes into the manifests beyond the tasks themselves."""

    namespace: str | None = None
    image: str | None = None
    pvc: str | None = None
    ttl_s: int = 86400
    cpu: str | None = None
    memory: str | None = None

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Kubernetes:
        """The settings from valid data."""
        values = dict(data)
        if "ttl_s" in data:
            values["ttl_s"] = _int(data["ttl_s"])
        return cls(**values)


@dataclass(frozen=True)
class Network:
    """How a run across hosts keeps its task ports to itself (local runs: see `isolation`)."""

    protect: Literal["auto", "off", "required"] = "auto"


@dataclass(frozen=True)
class SlurmOptions:
    """How the Slurm backend places tasks on the allocation's nodes."""

    tasks_per_node: int | None = None


@dataclass(frozen=True)
class Spec:
    """A whole cluster spec as the user wrote it (paths still relative), host files and
    `per_host` spread into `hosts` and task lists."""

    name: str
    strategy: Literal["multi_worker_mirrored", "parameter_server"]
    program: Program
    tasks: Tasks
    shared_dir: str = "./runs"
    timeouts: Timeouts = field(default_factory=Timeouts)
    restart: Restart = field(default_factory=Restart)
    host_template: Host | None = None
    hostfile: str | None = None
    hosts: Mapping[str, Host] = field(default_factory=dict)
    forward_env: tuple[str, ...] = ()
    tf_log_level: Literal["default", "all"] = "default"
    shared_dir_is_shared: bool = True
    isolation: Literal["auto", "off"] = "auto"
    permissions: Literal["private", "shared"] = "private"
    backend: str = backends.DEFAULT
    network: Network = field(default_factory=Network)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    kubernetes: Kubernetes = field(default_factory=Kubernetes)
    # The data it was made from, as written (the Python API sends it to the launcher process).
    data: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, data: Mapping[str, Any], written: Mapping[str, Any]) -> Spec:
        """The spec from valid, spread data; ``written`` is the data as the user wrote it."""
        parts = {
            "program": Program.of,
            "tasks": Tasks.of,
            "timeouts": Timeouts.of,
            "restart": Restart.of,
            "network": lambda d: Network(**d),
            "slurm": lambda d: SlurmOptions(
                None if d.get("tasks_per_node") is None else _int(d["tasks_per_node"])
            ),
            "kubernetes": Kubernetes.of,
            "host_template": lambda d: None if d is None else Host.of(d),
            "hosts": lambda d: {name: Host.of(host) for name, host in d.items()},
            "forward_env": tuple,
        }
        values = {key: parts.get(key, _same)(value) for key, value in data.items()}
        return cls(**values, data=written)

    @classmethod
    def model_validate(cls, data: Any) -> Spec:
        """A typed spec from data (the Python API's): SpecError where it is not one."""
        if not isinstance(data, Mapping):
            raise SpecError("<spec>", "$", f"expected a mapping, got {type(data).__name__}")
        raw = copy.deepcopy(dict(data))
        _check_schema(raw, "<spec>")
        spread = copy.deepcopy(raw)
        expand(Source(spread, "<spec>"), Path.cwd(), "<spec>", SpecOptions())
        return cls.of(spread, raw)

    def model_dump(self, mode: str = "json", exclude_unset: bool = True) -> dict[str, Any]:
        """The spec as the data it was made from (the values that were set)."""
        return copy.deepcopy(dict(self.data))


def _same(value: Any) -> Any:
    return value


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
        return _machine(self.spec, host)

    def ssh_host(self, name: str) -> Host | None:
        """The SSH host called ``name``; None when tasks on ``name`` run on this machine."""
        host = self.hosts.get(name)
        return host if host is not None and host.transport == "ssh" else None


def json_schema() -> dict[str, Any]:
    """Return the JSON Schema of the cluster spec file, as users write it: the document the
    validator is compiled from, with the installed backends' names."""
    return schema.published(backends.names())


YAML_SUFFIXES = (".yaml", ".yml")


def load_spec(path: str | Path, options: SpecOptions = SpecOptions()) -> LoadedSpec:
    """Read, validate and resolve the spec at ``path`` (JSON, or YAML 1.2 for .yaml/.yml) with
    the command line's ``options`` applied first; raise SpecError on any problem."""
    file = Path(path)
    shown = str(path)
    source = _read(file, shown)
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
        _check_schema(source.raw, shown)
        written = copy.deepcopy(source.raw)
        expand(source, base, shown, options)
        spec = Spec.of(source.raw, written)
        _check_spec(spec, shown, source.raw)
        return _resolve(spec, file, shown, source.raw)
    except SpecError as exc:
        raise source.locate(exc) from None


def _check_schema(raw: Any, shown: str) -> None:
    """SpecError for the first value the schema refuses (or a number no schema can hold)."""
    try:
        _check_numbers(raw, ())
        checker.validate(raw, {}, "data")
        name = raw.get("backend", backends.DEFAULT)
        try:
            backends.entry(name)
        except backends.UnknownBackend:
            names = [repr(n) for n in backends.names()]
            expected = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
            raise SpecError(shown, "$.backend", f"expected {expected}, got {shown_value(name)}")
    except Invalid as exc:
        raise spec_error(shown, raw, exc) from None
    except _BadNumber as exc:
        raise SpecError(shown, short_path(json_path(exc.loc)), exc.message) from None
    except RecursionError:
        raise SpecError(shown, "$", "nested too deeply; expected a cluster spec") from None


shown_value = shown


class _BadNumber(Exception):
    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        self.loc = loc
        self.message = message


def _check_numbers(node: Any, loc: tuple[str | int, ...]) -> None:
    """A float that is infinite or NaN, or an integer literal of over MAX_INT_DIGITS digits
    (JSON's, read as a `_Digits`), is no number a spec holds: say where it is."""
    if isinstance(node, dict):
        for key, child in node.items():
            _check_numbers(child, (*loc, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            _check_numbers(child, (*loc, i))
    elif isinstance(node, _Digits):
        raise _BadNumber(loc, huge_int_message(node.text))
    elif isinstance(node, float) and not math.isfinite(node):
        raise _BadNumber(loc, f"expected a finite number, got {shown(node)}")


class _Digits:
    """A JSON integer literal too long to be a number a spec needs (Python refuses to convert
    one over 4300 digits): no string, so that no string field takes it."""

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_int(text: str) -> int | _Digits:
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _Digits(text)


def _refuse_constant(text: str) -> float:
    return float(text)  # NaN and Infinity: found by _check_numbers with their path


def _check_spec(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    """What no schema can state about the whole spec: the number of tasks in all, one chief
    and one evaluator once `per_host` spread them."""
    roles = spec.tasks.by_role()
    total = sum(len(entries) for entries in roles.values())
    if total > MAX_TASKS:
        raise SpecError(shown, "$.tasks", f"expected at most {MAX_TASKS} tasks in all, got {total}")
    for role in (contract.CHIEF, contract.EVALUATOR):
        if role in roles and len(roles[role]) > 1:
            raise SpecError(
                shown, f"$.tasks.{role}", f"expected one {role} task, got {len(roles[role])}"
            )


def _read(file: Path, shown: str) -> Source:
    """The raw spec in ``file`` (YAML by its suffix, else JSON), checked for duplicate keys."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(shown, "$", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(shown, "$", f"cannot read: {exc}") from None
    if file.suffix.lower() in YAML_SUFFIXES:
        try:
            source = read_yaml(text, shown)
        except RecursionError:
            raise SpecError(shown, "$", "invalid YAML: nested too deeply") from None
        if not isinstance(source.raw, dict):
            raise SpecError(shown, "$", "expected a YAML mapping")
        return source
    try:
        raw = json.loads(
            text,
            object_pairs_hook=_DupCheckingDict.from_pairs,
            parse_int=_parse_int,
            parse_constant=_refuse_constant,
        )
    except json.JSONDecodeError as exc:
        raise SpecError(
            shown, "$", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise SpecError(shown, "$", "invalid JSON: nested too deeply") from None
    try:
        dup = _find_duplicate_key(raw, ())
    except RecursionError:
        raise SpecError(shown, "$", "nested too deeply; expected a cluster spec") from None
    if dup is not None:
        loc, key = dup
        where = short_path(json_path(loc + (key,)))
        raise SpecError(shown, where, f"key {preview(key)} appears twice; expected it once")
    if not isinstance(raw, dict):
        raise SpecError(shown, "$", "expected a JSON object")
    return Source(raw=raw, file=shown)


def _exists(path: Path, test: Callable[[Path], bool]) -> bool:
    """``test(path)``, false where the OS cannot even look (a name longer than NAME_MAX raises
    ENAMETOOLONG, which ``Path.is_file`` lets through on Python 3.11)."""
    try:
        return test(path)
    except OSError:
        return False


def _resolve(spec: Spec, file: Path, shown: str, raw: dict[str, Any]) -> LoadedSpec:
    """Resolve relative paths against the spec file's folder and check what must exist."""
    base = file.resolve().parent
    workdir = (base / spec.program.workdir).resolve() if spec.program.workdir else base
    if not _exists(workdir, Path.is_dir):
        raise SpecError(
            shown,
            "$.program.workdir",
            f"expected an existing directory, got {preview(str(workdir), 80)}",
        )
    script = None
    if spec.program.script is not None:
        script = (base / spec.program.script).resolve()
        if not _exists(script, Path.is_file):
            raise SpecError(
                shown,
                "$.program.script",
                f"expected an existing script file, got {preview(str(script), 80)}",
            )
    hosts = _resolve_hosts(spec, base, shown)
    if backends.entry(spec.backend).hosts_are_nodes:
        _check_fits_nodes(spec, shown, raw)
    else:
        _check_task_hosts(spec, shown, raw)
    _check_unique_ports(spec, shown, raw)
    _check_gpus(spec, shown, raw)
    _check_python(spec, workdir, shown)
    shared_dir = (base / spec.shared_dir).resolve()
    _check_shared_dir(shared_dir, shown)
    return LoadedSpec(
        spec=spec,
        file=file,
        raw=raw,
        shared_dir=shared_dir,
        workdir=workdir,
        script=script,
        hosts=hosts,
        shown=shown,
    )


def _check_python(spec: Spec, workdir: Path, shown: str) -> None:
    """program.python must be an executable here when a task runs here: else every start fails
    with exit 127 (which a restart policy would retry)."""
    python = spec.program.python
    hosts = [e.host for entries in spec.tasks.by_role().values() for e in entries]
    local = any(not _is_ssh(spec, host) for host in hosts)
    if python is None or backends.entry(spec.backend).own_python or not local:
        return
    # A path with a slash is relative to the task's working dir (where it is executed from).
    found = str(workdir / python) if "/" in python else shutil.which(python)
    if found is None or not (os.path.isfile(found) and os.access(found, os.X_OK)):
        raise SpecError(
            shown, "$.program.python", f"expected an executable interpreter, got {python!r}"
        )


def _check_shared_dir(shared_dir: Path, shown: str) -> None:
    """The shared dir must be a folder, or creatable: its nearest existing ancestor a folder."""
    for path in (shared_dir, *shared_dir.parents):
        try:
            exists, is_dir = path.exists(), path.is_dir()
        except OSError as exc:  # a name the file system cannot hold (ENAMETOOLONG)
            what = f"cannot use {preview(str(path), 80)}: {exc.strerror}"
            raise SpecError(shown, "$.shared_dir", what) from None
        if exists:
            if not is_dir:
                what = f"expected a directory, but {str(path)!r} is a file"
                raise SpecError(shown, "$.shared_dir", what)
            return


def _resolve_hosts(spec: Spec, base: Path, shown: str) -> dict[str, Host]:
    """The spec's hosts with identity files made absolute; each must exist."""
    out = {}
    for name, host in spec.hosts.items():
        if host.identity_file is not None:
            identity = (base / Path(host.identity_file).expanduser()).resolve()
            if not _exists(identity, Path.is_file):
                raise SpecError(
                    shown,
                    _json_path(("hosts", name, "identity_file")),
                    f"expected an existing key file, got {str(identity)!r}",
                )
            host = replace(host, identity_file=str(identity))
        out[name] = host
    return out


def _check_task_hosts(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    """Every task names a known host, and local tasks are reachable when other tasks are remote."""
    names = ", ".join([*LOCAL_HOSTS, *spec.hosts])
    entries = [
        (role, i, e) for role, group in spec.tasks.by_role().items() for i, e in enumerate(group)
    ]
    for role, i, entry in entries:
        if entry.host not in LOCAL_HOSTS and entry.host not in spec.hosts:
            raise SpecError(
                shown,
                _task_path(raw, role, i, "host"),
                f"unknown host {entry.host!r}; expected one of: {names}",
            )
    remote = any(_is_ssh(spec, e.host) for _, _, e in entries)
    for role, i, entry in entries:
        if remote and not _is_ssh(spec, entry.host) and _is_loopback(_machine(spec, entry.host)):
            fix = (
                f"set {_json_path(('hosts', entry.host, 'address'))} to"
                if entry.host in spec.hosts
                else 'name this machine in $.hosts with "transport": "local" and'
            )
            raise SpecError(
                shown,
                _task_path(raw, role, i, "host"),
                f"tasks on SSH hosts cannot reach a task on {entry.host!r} (loopback); {fix} "
                "the address the other hosts reach this machine at",
            )


def _check_fits_nodes(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    """Where the backend allocates the nodes (Slurm), a task's host is a node of the allocation
    (checked when `up` starts), SSH hosts do not apply, and it picks the GPU devices: a task
    asks for a count."""
    if spec.hosts:
        raise SpecError(
            shown,
            "$.hosts",
            f"the {spec.backend} backend runs tasks on the allocation's nodes; remove `hosts`",
        )
    for role, entries in spec.tasks.by_role().items():
        for i, entry in enumerate(entries):
            if isinstance(entry.gpus, tuple):
                raise SpecError(
                    shown,
                    _task_path(raw, role, i, "gpus"),
                    f"expected a GPU count under Slurm (it picks the devices), got the list {list(entry.gpus)}",
                )
            if isinstance(entry.cpus, tuple):
                raise SpecError(
                    shown,
                    _task_path(raw, role, i, "cpus"),
                    'expected a CPU count, "auto" or "all" under Slurm (it picks the CPUs), got '
                    f"the list {preview(list(entry.cpus))}",
                )


def _is_ssh(spec: Spec, host: str) -> bool:
    return host in spec.hosts and spec.hosts[host].transport == "ssh"


def _is_loopback(address: str) -> bool:
    return address == "localhost" or address.startswith("127.")


def _machine(spec: Spec, host: str) -> str:
    """Which machine a task's host is, for per-machine checks: its address (127.0.0.1 for this one)."""
    if host in spec.hosts:
        return spec.hosts[host].address_of(host)
    # Not "localhost": it may resolve to ::1 first, which TensorFlow then dials.
    return "127.0.0.1"


def _check_unique_ports(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    seen: dict[tuple[str, int], str] = {}
    for role, entries in spec.tasks.by_role().items():
        for i, entry in enumerate(entries):
            if isinstance(entry.port, int):
                key = (_machine(spec, entry.host), entry.port)
                where = _task_path(raw, role, i, "port")
                if key in seen:
                    raise SpecError(
                        shown,
                        where,
                        f"port {entry.port} is already used by {seen[key]}; expected a unique port",
                    )
                seen[key] = where


def _check_gpus(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    """Explicit GPU lists of tasks on one host must not overlap."""
    owner: dict[tuple[str, int], str] = {}
    for role, entries in spec.tasks.by_role().items():
        for i, entry in enumerate(entries):
            if isinstance(entry.gpus, tuple):
                for gpu in entry.gpus:
                    where = _task_path(raw, role, i, "gpus")
                    key = (_machine(spec, entry.host), gpu)
                    if key in owner:
                        raise SpecError(
                            shown,
                            where,
                            f"GPU {gpu} is already given to {owner[key]}; tasks on one host never share a GPU",
                        )
                    owner[key] = where


def task_json_path(raw: dict[str, Any], role: str, index: int, key: str) -> str:
    """Return the JSON path where task ``role:index``'s ``key`` is written in the raw spec."""
    return _task_path(raw, role, index, key)


def _task_path(raw: dict[str, Any], role: str, index: int, key: str) -> str:
    group = raw.get("tasks", {}).get(role)
    if isinstance(group, list):
        return _json_path(("tasks", role, index, key))
    return _json_path(("tasks", role, key))


class _DupCheckingDict(dict):
    """A JSON object that remembers a key it saw twice (json.loads keeps the last silently)."""

    duplicate: str | None = None

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, Any]]) -> _DupCheckingDict:
        obj = cls()
        for key, value in pairs:
            if key in obj and obj.duplicate is None:
                obj.duplicate = key
            obj[key] = value
        return obj


def _find_duplicate_key(
    node: Any, loc: tuple[str | int, ...]
) -> tuple[tuple[str | int, ...], str] | None:
    if isinstance(node, _DupCheckingDict):
        if node.duplicate is not None:
            return loc, node.duplicate
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for key, child in items:
        found = _find_duplicate_key(child, loc + (key,))
        if found:
            return found
    return None


def _json_path(loc: tuple[str | int, ...]) -> str:
    """``loc`` as an error message shows it: a long key (JSON has no key length bound) is cut."""
    return short_path(json_path(loc))
