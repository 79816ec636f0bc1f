"""What no schema can state about a spec: checks across fields, and paths that must exist.

Run on the typed spec once the schema has passed (spec/model.py's `load_spec`): the number of tasks
in all, the hosts tasks name, ports and GPUs two tasks on one machine would share, the files and
folders the spec names, an elastic range the worker role and the backend can hold. Each failure
is a SpecError with the JSON path of the value at fault.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from distlaunch.launcher.core import backends
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec.invalid import json_path, short_path
from distlaunch.launcher.spec.rules import LOCAL_HOSTS, MAX_TASKS
from distlaunch.launcher.spec.sources import preview
from distlaunch.launcher.spec.typed import Host, Spec
from distlaunch.worker import contract


def check_spec(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
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
    _check_elastic(spec, shown)


# What an elastic run needs of a backend that cannot resize one, by its name.
CANNOT_RESIZE = {
    "compose": "the compose backend cannot resize a run (each container's TF_CONFIG is fixed "
    "in the compose file when it starts); run it on the local backend (SSH hosts) or slurm, or "
    "remove elastic",
    "kubernetes": "the Kubernetes manifests cannot resize a run (each pod's TF_CONFIG is fixed "
    "in its manifest): that needs a controller that watches the pods, re-forms TF_CONFIG and "
    "restarts every pod at the new size, which `distlaunch k8s` does not write; run it with "
    "`distlaunch up` (SSH hosts or slurm), or remove elastic",
}


def refuse_elastic(spec: Spec, shown: str, target: str) -> None:
    """SpecError when ``spec`` is elastic and is to run where nothing resizes it: ``target``
    names the backend or export ("compose", "kubernetes")."""
    if spec.elastic is not None:
        what = CANNOT_RESIZE.get(
            target, f"the {target} backend cannot resize a run; remove elastic"
        )
        raise SpecError(shown, "$.elastic", what)


def _check_elastic(spec: Spec, shown: str) -> None:
    """The range fits the worker role's tasks (the slots a world is chosen from), ``sizes``
    leaves a size in it, and the backend can resize a run."""
    elastic = spec.elastic
    if elastic is None:
        return
    if not backends.entry(spec.backend).resizes:
        refuse_elastic(spec, shown, spec.backend)
    workers = spec.tasks.worker or ()
    if not workers:
        raise SpecError(
            shown,
            "$.elastic",
            "an elastic run ranges over the worker role's tasks; expected tasks.worker",
        )
    low, high, slots = elastic.min_workers, elastic.max_workers, len(workers)
    written = spec.data.get("elastic", {}).get("workers", elastic.range_text)
    where = "$.elastic.workers"
    # "MIN:" takes MAX from the slots: a MIN above them is then the hosts' shortfall.
    if high < low and not written.endswith(":"):
        raise SpecError(shown, where, f'expected MIN <= MAX, got "{written}"')
    if slots < low:
        raise SpecError(
            shown,
            where,
            f"MIN {low} is more workers than the hosts can hold: tasks.worker has "
            f"{_tasks(slots)} ({_slots_text(spec, workers)}); expected MIN <= {slots}",
        )
    if high > slots:
        raise SpecError(
            shown,
            where,
            f"MAX {high} is more than tasks.worker's {_tasks(slots)}, the slots a world is "
            f"chosen from ({_slots_text(spec, workers)}); expected MAX <= {slots}, or more "
            "worker tasks",
        )
    if elastic.sizes is not None and not elastic.accepted():
        raise SpecError(
            shown,
            "$.elastic.sizes",
            f"expected at least one size within {low}..{high} (elastic.workers), got "
            f"{list(elastic.sizes)}",
        )
    if elastic.cooldown_max_s < elastic.cooldown_s:
        # The cooldown doubles from cooldown_s up to cooldown_max_s: a cap below the start
        # would hold a flapping host out for less than a host that failed once.
        raise SpecError(
            shown,
            "$.elastic.cooldown_max_s",
            f"expected at least elastic.cooldown_s ({elastic.cooldown_s:g}), got "
            f"{elastic.cooldown_max_s:g}",
        )


def _tasks(n: int) -> str:
    return f"{n} task" if n == 1 else f"{n} tasks"


def _slots_text(spec: Spec, workers: tuple[Any, ...]) -> str:
    """Where the worker role's tasks are, in words: "2 on a, 1 on b"."""
    if backends.entry(spec.backend).hosts_are_nodes:
        return "placed on the allocation's nodes"
    return ", ".join(f"{n} on {host}" for host, n in Counter(e.host for e in workers).items())


def _exists(path: Path, test: Callable[[Path], bool]) -> bool:
    """``test(path)``, false where the OS cannot even look (a name longer than NAME_MAX raises
    ENAMETOOLONG, which ``Path.is_file`` lets through on Python 3.11)."""
    try:
        return test(path)
    except OSError:
        return False


@dataclass(frozen=True)
class Paths:
    """What a spec's relative paths resolve to, each checked to exist (or be creatable)."""

    workdir: Path
    script: Path | None
    shared_dir: Path
    # The spec's hosts with identity files made absolute.
    hosts: dict[str, Host]


def resolve_paths(spec: Spec, file: Path, shown: str, raw: dict[str, Any]) -> Paths:
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
    return Paths(workdir=workdir, script=script, shared_dir=shared_dir, hosts=hosts)


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
                task_path(raw, role, i, "host"),
                f"unknown host {entry.host!r}; expected one of: {names}",
            )
    remote = any(_is_ssh(spec, e.host) for _, _, e in entries)
    for role, i, entry in entries:
        if remote and not _is_ssh(spec, entry.host) and _is_loopback(machine(spec, entry.host)):
            fix = (
                f"set {_json_path(('hosts', entry.host, 'address'))} to"
                if entry.host in spec.hosts
                else 'name this machine in $.hosts with "transport": "local" and'
            )
            raise SpecError(
                shown,
                task_path(raw, role, i, "host"),
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
                    task_path(raw, role, i, "gpus"),
                    f"expected a GPU count under Slurm (it picks the devices), got the list {list(entry.gpus)}",
                )
            if isinstance(entry.cpus, tuple):
                raise SpecError(
                    shown,
                    task_path(raw, role, i, "cpus"),
                    'expected a CPU count, "auto" or "all" under Slurm (it picks the CPUs), got '
                    f"the list {preview(list(entry.cpus))}",
                )


def _is_ssh(spec: Spec, host: str) -> bool:
    return host in spec.hosts and spec.hosts[host].transport == "ssh"


def _is_loopback(address: str) -> bool:
    return address == "localhost" or address.startswith("127.")


def machine(spec: Spec, host: str) -> str:
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
                key = (machine(spec, entry.host), entry.port)
                where = task_path(raw, role, i, "port")
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
                    where = task_path(raw, role, i, "gpus")
                    key = (machine(spec, entry.host), gpu)
                    if key in owner:
                        raise SpecError(
                            shown,
                            where,
                            f"GPU {gpu} is already given to {owner[key]}; tasks on one host never share a GPU",
                        )
                    owner[key] = where


def task_json_path(raw: dict[str, Any], role: str, index: int, key: str) -> str:
    """Return the JSON path where task ``role:index``'s ``key`` is written in the raw spec."""
    return task_path(raw, role, index, key)


def task_path(raw: dict[str, Any], role: str, index: int, key: str) -> str:
    group = raw.get("tasks", {}).get(role)
    if isinstance(group, list):
        return _json_path(("tasks", role, index, key))
    return _json_path(("tasks", role, key))


def _json_path(loc: tuple[str | int, ...]) -> str:
    """``loc`` as an error message shows it: a long key (JSON has no key length bound) is cut."""
    return short_path(json_path(loc))
