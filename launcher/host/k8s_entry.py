"""The entrypoint of a task in a Kubernetes pod: TF_CONFIG from the pod's index, then the program.

`distlaunch k8s` writes one Indexed Job per role, so every pod of a role has the same spec and
only Kubernetes knows which index a pod is: it says so in JOB_COMPLETION_INDEX when the pod
starts. This module turns that index, the role (DISTLAUNCH_ROLE) and the role's training cluster
(DISTLAUNCH_CLUSTER, written into the manifest) into the task's TF_CONFIG and the per-task part
of the distlaunch environment contract (index, error, status and metrics files), creates the
run-dir folders those files go in, and then runs the program under `pod_init`, which stays as
the pod's PID 1: it turns the pod's SIGTERM into a stop notice where the program can save
(``--notice``: see pod_init), reaps orphans, and exits with the program's code.

    python -m distlaunch.host.k8s_entry [--umask 077] [--notice program] [--save-s 30] \
        -- python -m my.trainer --epochs 3

A pod whose environment is wrong (a manifest edited by hand) exits 2, which `distlaunch k8s`
marks as non-retryable by default: retrying cannot fix it. It never imports launcher code.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from distlaunch.worker import contract

from . import pod_init

USAGE = (
    "usage: python -m distlaunch.host.k8s_entry [--umask OCTAL] [--notice program|chief|group] "
    "[--save-s S] -- PROGRAM [ARGS...]"
)


class EntryError(Exception):
    """The pod's environment or command line cannot make a task (one line, exit 2)."""


@dataclass(frozen=True)
class Options:
    """This module's command line."""

    program: list[str]
    umask: int | None = None
    notice: pod_init.Notice = pod_init.Notice.GROUP
    save_s: float = 30.0


def task_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for this pod's task: TF_CONFIG and the per-task contract."""
    role = environ.get(contract.ROLE, "")
    try:
        index = int(environ.get(contract.JOB_COMPLETION_INDEX, ""))
        cluster = json.loads(environ.get(contract.CLUSTER, ""))
    except ValueError:
        raise EntryError(
            f"expected {contract.JOB_COMPLETION_INDEX} (an integer, set by an Indexed Job) and "
            f"{contract.CLUSTER} (JSON) in the environment"
        ) from None
    if not isinstance(cluster, dict) or not (0 <= index < len(cluster.get(role) or [])):
        raise EntryError(f"no task {role}:{index} in {contract.CLUSTER} {json.dumps(cluster)}")
    env = {
        contract.TF_CONFIG: json.dumps(
            {"cluster": cluster, "task": {"type": role, "index": index}},
            separators=(",", ":"),
        ),
        contract.INDEX: str(index),
    }
    run_dir = environ.get(contract.RUN_DIR)
    if run_dir:
        attempt = int(environ.get(contract.ATTEMPT) or 0)
        env[contract.ERROR_FILE] = str(contract.error_path(Path(run_dir), attempt, role, index))
        env[contract.STATUS_FILE] = str(contract.status_path(Path(run_dir), role, index))
        env[contract.METRICS_FILE] = str(contract.metrics_path(Path(run_dir), role, index))
    return env


def _parse(argv: list[str]) -> Options:
    """The options and program argv of this module's command line."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise EntryError(USAGE)
    split = argv.index("--")
    flags = argv[:split]
    if len(flags) % 2:
        raise EntryError(USAGE)
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    readers = {"--umask": lambda v: int(v, 8), "--notice": pod_init.Notice, "--save-s": float}
    values: dict[str, object] = {}
    for flag, value in given.items():
        if flag not in readers:
            raise EntryError(USAGE)
        try:
            values[flag.removeprefix("--").replace("-", "_")] = readers[flag](value)
        except ValueError:
            raise EntryError(f"{flag}: unexpected value {value!r}; {USAGE}") from None
    return Options(argv[split + 1 :], **values)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    """Build this pod's task environment and run the program (see the module docstring)."""
    try:
        options = _parse(sys.argv[1:] if argv is None else argv)
        env = task_env(os.environ)
    except EntryError as exc:
        print(f"distlaunch: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if options.umask is not None:
        os.umask(options.umask)
    os.environ.update(env)
    # The files' folders, which nobody else creates on a fresh volume.
    for name in (contract.ERROR_FILE, contract.STATUS_FILE, contract.METRICS_FILE):
        if name in env:
            Path(env[name]).parent.mkdir(parents=True, exist_ok=True)
    checkpoints = contract.env_path(contract.CHECKPOINT_DIR)
    if checkpoints is not None:
        checkpoints.mkdir(parents=True, exist_ok=True)
    name = contract.task_name(os.environ.get(contract.ROLE, ""), int(env[contract.INDEX]))
    print(
        f"distlaunch: {name}: TF_CONFIG {env[contract.TF_CONFIG]}",
        file=sys.stderr,
        flush=True,
    )
    run_dir = contract.env_path(contract.RUN_DIR)
    chief = contract.status_path(run_dir, contract.CHIEF, 0) if run_dir else None
    status = contract.env_path(contract.STATUS_FILE)
    sys.exit(pod_init.run(options.program, options.notice, status, chief, options.save_s))


if __name__ == "__main__":
    main()
