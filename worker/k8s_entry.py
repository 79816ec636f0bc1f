"""The entrypoint of a task in a Kubernetes pod: TF_CONFIG from the pod's index, then the program.

`distlaunch k8s` writes one Indexed Job per role, so every pod of a role has the same spec and
only Kubernetes knows which index a pod is: it says so in JOB_COMPLETION_INDEX when the pod
starts. This module turns that index, the role (DISTLAUNCH_ROLE) and the role's training cluster
(DISTLAUNCH_CLUSTER, written into the manifest) into the task's TF_CONFIG and the per-task part
of the distlaunch environment contract (index, error, status and metrics files), creates the
run-dir folders those files go in, and then execs the program: no process stays in between, so
signals and the exit code are the program's own.

    python -m distlaunch.worker.k8s_entry [--umask 077] -- python -m my.trainer --epochs 3

A pod whose environment is wrong (a manifest edited by hand) exits 2, which `distlaunch k8s`
marks as non-retryable by default: retrying cannot fix it. It never imports launcher code.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from . import contract

USAGE = "usage: python -m distlaunch.worker.k8s_entry [--umask OCTAL] -- PROGRAM [ARGS...]"


class EntryError(Exception):
    """The pod's environment or command line cannot make a task (one line, exit 2)."""


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


def _parse(argv: list[str]) -> tuple[int | None, list[str]]:
    """(umask, program argv) from this module's command line."""
    umask = None
    if argv[:1] == ["--umask"] and len(argv) >= 2:
        try:
            umask = int(argv[1], 8)
        except ValueError:
            raise EntryError(f"--umask: expected an octal number, got {argv[1]!r}") from None
        argv = argv[2:]
    if argv[:1] != ["--"] or len(argv) < 2:
        raise EntryError(USAGE)
    return umask, argv[1:]


def main(argv: list[str] | None = None) -> None:
    """Build this pod's task environment and exec the program (see the module docstring)."""
    try:
        umask, program = _parse(sys.argv[1:] if argv is None else argv)
        env = task_env(os.environ)
    except EntryError as exc:
        print(f"distlaunch: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if umask is not None:
        os.umask(umask)
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
    os.execvp(program[0], program)


if __name__ == "__main__":
    main()
