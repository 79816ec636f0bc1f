"""The JSON Schema of the cluster spec as users write it: the one statement of what a valid spec is.

`distlaunch schema` prints it (editors and CI linters read it), the reference docs are made from
its descriptions, and spec/checker.py is this document compiled by fastjsonschema: validation
and the published schema cannot disagree. What no schema can state (the sum of all tasks, ports
and GPUs shared between tasks, files that must exist) is checked in spec/checks.py. The parts
are spec/schema_tasks.py (roles, tasks, hosts) and spec/schema_run.py (program, timeouts,
restarts, elastic runs, Kubernetes, strategies); the limits and patterns are spec/rules.py's.

Keys beside the standard ones, for the one-line errors (spec/invalid.py): ``x-expected`` says
what a value should be ("expected X, got Y"), ``x-error`` is the whole message of a rule, and
``x-key`` what a key of a name -> value map should be. Validators and editors ignore them.

Patterns are ECMA-262 (as JSON Schema says): ``$`` ends the text.
"""

from __future__ import annotations

from typing import Any

from distlaunch.launcher.spec.rules import (
    HOST_KEY,
    HOST_KEY_EXPECTED,
    MAX_TASKS,
    optional_text,
    text,
)
from distlaunch.launcher.spec.schema_run import (
    elastic,
    kubernetes,
    program,
    restart,
    strategy_rules,
    timeouts,
)
from distlaunch.launcher.spec.schema_tasks import host, role, task


def document() -> dict[str, Any]:
    """The schema document (the backend's names are a string here: `published` lists them)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "distlaunch cluster spec",
        "description": "A whole cluster spec as the user writes it (JSON, or YAML 1.2); relative "
        "paths are relative to the spec file's folder.",
        "type": "object",
        "$defs": {
            "host": host(),
            "task": task(),
            "role": role(MAX_TASKS),
            "one_task_role": role(1),
        },
        "properties": {
            "name": {
                "type": "string",
                "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                "maxLength": 64,
                "x-expected": "a name of letters, digits, '.', '-', '_' (at most 64 characters)",
                "description": "The run's name: run dirs, containers and Kubernetes objects are "
                "named after it.",
            },
            "strategy": {
                "enum": ["multi_worker_mirrored", "parameter_server"],
                "description": "The TensorFlow distribution strategy the program uses: which "
                "roles it needs.",
            },
            "program": program(),
            "tasks": {
                "type": "object",
                "description": "Tasks by role, as TensorFlow names them in TF_CONFIG.",
                "properties": {
                    "chief": {
                        "$ref": "#/$defs/one_task_role",
                        "description": "The chief: one task.",
                    },
                    "worker": {"$ref": "#/$defs/role", "description": "The workers."},
                    "ps": {
                        "$ref": "#/$defs/role",
                        "description": "Parameter servers (parameter_server only).",
                    },
                    "evaluator": {
                        "$ref": "#/$defs/one_task_role",
                        "description": "The evaluator: one task.",
                    },
                },
                "additionalProperties": False,
            },
            "shared_dir": {
                **text(
                    "Where runs are written, one run dir each (relative: to the spec).",
                    default="./runs",
                    minLength=1,
                    maxLength=4096,
                ),
                "allOf": [
                    {
                        "not": {"pattern": "[^/]{256}"},
                        "x-error": "expected path components of at most 255 characters",
                    }
                ],
            },
            "timeouts": {**timeouts(), "default": {}},
            "restart": {**restart(), "default": {}},
            "elastic": {**elastic(), "type": ["object", "null"], "default": None},
            "host_template": {
                "$ref": "#/$defs/host",
                "description": "Settings every host of `hostfile` starts from (user, python, ...).",
            },
            "hostfile": {
                **optional_text(
                    "A host file (relative: to the spec), one SSH host per line as `node1 "
                    "slots=4`; its hosts join `hosts` with host_template's settings. slots caps "
                    "per_host.",
                    minLength=1,
                ),
            },
            "hosts": {
                "type": "object",
                "patternProperties": {HOST_KEY: {"$ref": "#/$defs/host"}},
                "additionalProperties": False,
                "x-key": HOST_KEY_EXPECTED,
                "default": {},
                "description": "Machines by name, for tasks' `host`; localhost needs no entry.",
            },
            "forward_env": {
                "type": "array",
                "items": {
                    "type": "string",
                    "pattern": r"^[A-Za-z0-9_*?\[\]!-]+$",
                    "x-expected": 'a variable name or glob pattern ("NCCL_*")',
                },
                "default": [],
                "description": 'Names or glob patterns ("NCCL_*") of the launcher\'s environment '
                "variables sent to every task on every backend; secret-looking values are masked "
                "in plan.",
            },
            "tf_log_level": {
                "enum": ["default", "all"],
                "default": "default",
                "description": "default: the console hides TensorFlow's C++ INFO lines and its "
                "known harmless start-up warnings (oneDNN, CUDA probes, cpu_feature_guard, absl); "
                "the log files keep them. all: the console shows everything.",
            },
            "shared_dir_is_shared": {
                "type": "boolean",
                "default": True,
                "description": "true: every SSH host sees shared_dir at the same path (a shared "
                "mount). false: each host writes its run files to that path on its own disk; "
                "`distlaunch collect RUN` copies them back.",
            },
            "isolation": {
                "enum": ["auto", "off"],
                "default": "auto",
                "description": "auto: when every task runs on this machine's loopback and the "
                "machine allows it, the run's tasks share a private network namespace with "
                "loopback only, so their unauthenticated TensorFlow ports cannot be reached from "
                "outside the run (and the tasks cannot reach the network: no downloads). off: "
                "tasks use the machine's network; their ports are open to anyone who can reach "
                "them.",
            },
            "permissions": {
                "enum": ["private", "shared"],
                "default": "private",
                "description": "private: the run dir and everything the launcher and tasks "
                "create are owner-only (dirs 0700, files 0600; tasks run with umask 077). shared: "
                "they follow your umask, so others may read them.",
            },
            "backend": {
                "type": "string",
                "maxLength": 64,
                "default": "local",
                "description": "local: tasks are processes on this machine or its SSH hosts. "
                "compose: every task runs in a container of its own (the distlaunch image, built "
                "from this checkout) on an internal docker-compose network with no published "
                "port; TF_CONFIG names service names (worker-0:2222), the shared dir is mounted "
                "at the same path, and the image's python runs the program (program.python, task "
                "ports and isolation do not apply). slurm: inside a Slurm allocation (salloc, "
                "sbatch), every task is a job step on a node of the allocation; a task's `host` "
                "names a node, or is left out to be placed. `distlaunch up --backend` overrides "
                "it.",
            },
            "network": {
                "type": "object",
                "description": "The firewall of SSH hosts and Slurm nodes: how a run across "
                "hosts keeps its task ports to itself (local runs: see `isolation`).",
                "properties": {
                    "protect": {
                        "enum": ["auto", "off", "required"],
                        "default": "auto",
                        "description": "auto: for the run's lifetime each remote host admits "
                        "connections to the run's task ports only from the run's own hosts and "
                        "loopback (an nftables table per run, held by a guard on the host; needs "
                        "root or CAP_NET_ADMIN there), and `up` names the hosts whose ports stay "
                        "open where it cannot. required: such a host stops the run before "
                        "anything starts. off: no firewall.",
                    }
                },
                "additionalProperties": False,
                "default": {},
            },
            "slurm": {
                "type": "object",
                "description": "Placement on Slurm nodes (the other backends ignore it).",
                "properties": {
                    "tasks_per_node": {
                        "type": ["integer", "null"],
                        "minimum": 1,
                        "maximum": MAX_TASKS,
                        "default": None,
                        "description": "Fill each node with this many tasks before the next one "
                        "(default: spread the tasks over the nodes, one at a time).",
                    }
                },
                "additionalProperties": False,
                "default": {},
            },
            "kubernetes": kubernetes(),
        },
        "required": ["name", "strategy", "program", "tasks"],
        "additionalProperties": False,
        # The strategy's roles (after the keys are checked: `if` comes last).
        **strategy_rules(),
    }


def published(backend_names: tuple[str, ...]) -> dict[str, Any]:
    """The schema `distlaunch schema` prints: the document with the installed backends listed."""
    out = document()
    out["properties"]["backend"]["enum"] = list(backend_names)
    return out
