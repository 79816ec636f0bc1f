"""The JSON Schema of the cluster spec as users write it: the one statement of what a valid spec is.

`distlaunch schema` prints it (editors and CI linters read it), the reference docs are made from
its descriptions, and spec/checker.py is this document compiled by fastjsonschema: validation
and the published schema cannot disagree. What no schema can state (the sum of all tasks, ports
and GPUs shared between tasks, files that must exist) is checked in spec/model.py.

Keys beside the standard ones, for the one-line errors (spec/errors.py): ``x-expected`` says
what a value should be ("expected X, got Y"), ``x-error`` is the whole message of a rule, and
``x-key`` what a key of a name -> value map should be. Validators and editors ignore them.

Patterns are ECMA-262 (as JSON Schema says): ``$`` ends the text.
"""

from __future__ import annotations

from typing import Any

# At most this many tasks in one spec: TF_CONFIG lists every task in every task's environment,
# so a plan grows with the square of the count (50,000 tasks took 24 GB).
MAX_TASKS = 4096
# At most this many GPUs (and CPUs) per task: a count is expanded into indices one by one.
MAX_GPUS = 1024
MAX_CPUS = 4096
# Seconds and counts end up in Kubernetes fields that are int32 (ttlSecondsAfterFinished,
# backoffLimit): no larger value is accepted anywhere.
MAX_INT32 = 2**31 - 1
# ssh options distlaunch sets itself: a spec that changed them would break connection sharing,
# the host-key policy or the launcher's hold on the remote task.
OWNED_SSH_OPTIONS = (
    "BatchMode",
    "ConnectTimeout",
    "ControlMaster",
    "ControlPath",
    "ControlPersist",
    "ForkAfterAuthentication",
    "RemoteCommand",
    "RequestTTY",
    "SessionType",
    "StdinNull",
    "StrictHostKeyChecking",
)
# Environment names the launcher owns; a spec may not set them.
RESERVED_ENV = r"^(TF_CONFIG|DISTLAUNCH_.*)$"
LOCAL_HOSTS = ("localhost", "127.0.0.1")
# A host's name in the spec, and an address: a DNS name or an IPv4 address (TF_CONFIG writes
# host:port, which an IPv6 literal would make ambiguous). Never starts with "-", so it cannot be
# read as an option by ssh.
HOST_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
# Kubernetes names: a namespace is a DNS label, a PersistentVolumeClaim a DNS subdomain.
K8S_LABEL = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
K8S_SUBDOMAIN = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$"
# An image reference (registry/name:tag@digest): no space, quote or shell character in it.
IMAGE_REF = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
# A Kubernetes quantity such as "500m", "2" or "8Gi".
K8S_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
MODULE_RE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
# Text passed to a process (argv, environment, paths): a NUL would end it as a C string.
NO_NUL = "^[^\\u0000]*$"
ROLES = ("chief", "worker", "ps", "evaluator")
TASK_KEYS = ("host", "port", "gpus", "cpus")
ONE_ENTRY_POINT = 'expected exactly one of "script" or "module"'


def _text(description: str, **more: Any) -> dict[str, Any]:
    """A string passed to a process."""
    return {
        "type": "string",
        "pattern": NO_NUL,
        "x-expected": "text without a NUL character",
        "description": description,
        **more,
    }


def _optional_text(description: str, **more: Any) -> dict[str, Any]:
    return {**_text(description, **more), "type": ["string", "null"], "default": None}


def _seconds(description: str, default: float | None, *, zero: bool = False) -> dict[str, Any]:
    low = {"minimum": 0} if zero else {"exclusiveMinimum": 0}
    return {
        "type": "number" if default is not None else ["number", "null"],
        **low,
        "maximum": MAX_INT32,
        "default": default,
        "description": description,
    }


def _owned_options_pattern() -> str:
    """ssh -o keys distlaunch owns, any case (ssh reads them so): no inline flags in ECMA."""
    words = "|".join(
        "".join(f"[{c.upper()}{c.lower()}]" for c in option) for option in OWNED_SSH_OPTIONS
    )
    return f"^({words})="


def _role(max_tasks: int) -> dict[str, Any]:
    """A role's tasks: a list of tasks, or a count of tasks sharing their settings."""
    many_one = "a fixed port needs one task; list the tasks to give each its own port"
    return {
        "description": "The role's tasks: a list of tasks, each with its own settings, or "
        '`{"count": N, ...}`: N tasks sharing the settings beside the count (`per_host` spreads '
        "them over `hosts`). null: no such task.",
        "if": {"type": "array"},
        "then": {
            "type": "array",
            "items": {"$ref": "#/$defs/task"},
            "minItems": 1,
            "maxItems": max_tasks,
            **({"x-expected": "a list of one task (the role has one)"} if max_tasks == 1 else {}),
        },
        "else": {
            "if": {"type": "null"},
            "then": {"type": "null"},
            "else": {
                "type": "object",
                "x-expected": '{"count": N, ...} or a list of tasks',
                "properties": {
                    "count": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": max_tasks,
                        **({"x-expected": "1 (the role has one task)"} if max_tasks == 1 else {}),
                        "default": 1,
                        "description": "How many tasks (with per_host: default per_host times the "
                        "number of hosts).",
                    },
                    "per_host": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": max_tasks,
                        "description": "Spread the tasks over `hosts` (or the host file), this many "
                        "on each host in order; a host file's slots cap it.",
                    },
                    **{key: {"$ref": f"#/$defs/task/properties/{key}"} for key in TASK_KEYS},
                },
                "additionalProperties": False,
                "allOf": [
                    {  # several tasks on one machine: no fixed port, no list of devices
                        "if": {
                            "anyOf": [
                                {
                                    "required": ["count"],
                                    "properties": {"count": {"minimum": 2}},
                                    "not": {"required": ["per_host"]},
                                },
                                {
                                    "required": ["per_host"],
                                    "properties": {"per_host": {"minimum": 2}},
                                },
                            ]
                        },
                        "then": {
                            "properties": {
                                "port": {"not": {"type": "integer"}, "x-error": many_one},
                                "gpus": {
                                    "not": {"type": "array"},
                                    "x-error": "a GPU list for several tasks on one host would "
                                    "share its GPUs; give a count, or list the tasks",
                                },
                                "cpus": {
                                    "not": {"type": "array"},
                                    "x-error": "a CPU list for several tasks on one host would "
                                    "share its CPUs; give a count, or list the tasks",
                                },
                            }
                        },
                    },
                    {
                        "if": {"required": ["count"], "properties": {"count": {"minimum": 2}}},
                        "then": {
                            "properties": {
                                "port": {"not": {"type": "integer"}, "x-error": many_one}
                            }
                        },
                    },
                    {
                        "if": {"required": ["per_host"]},
                        "then": {
                            "properties": {
                                "host": {
                                    "not": {},
                                    "x-error": "per_host spreads tasks over `hosts`; remove host",
                                }
                            }
                        },
                    },
                ],
            },
        },
    }


def _host() -> dict[str, Any]:
    ssh_only = (
        "user",
        "port",
        "identity_file",
        "ssh_options",
        "python",
        "workdir",
        "host_key_checking",
        "connect_timeout_s",
    )
    return {
        "type": "object",
        "description": "A machine tasks are placed on by name: this one (`local`) or one reached "
        "over SSH.",
        "properties": {
            "transport": {
                "enum": ["local", "ssh"],
                "default": "ssh",
                "description": "local: this machine; ssh: over the system's ssh.",
            },
            "address": {
                "type": ["string", "null"],
                "pattern": HOST_RE,
                "maxLength": 253,
                "x-expected": "a host name or IPv4 address (letters, digits, '.', '-', '_')",
                "default": None,
                "description": "Name or IPv4 address every host reaches this one at: TF_CONFIG "
                "names it and ssh connects to it (default: the host's name for ssh, 127.0.0.1 "
                "for local).",
            },
            "user": {
                "type": ["string", "null"],
                "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
                "maxLength": 256,
                "x-expected": "a login name (letters, digits, '.', '-', '_')",
                "default": None,
                "description": "SSH login (default: ssh's).",
            },
            "port": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": 65535,
                "default": None,
                "description": "SSH port (default: ssh's, usually 22).",
            },
            "identity_file": _optional_text(
                "SSH private key (relative: to the spec).", minLength=1
            ),
            "ssh_options": {
                "type": "array",
                "default": [],
                "description": 'More ssh options, each "Key=Value" as for `ssh -o`; the ones '
                "distlaunch sets itself (" + ", ".join(OWNED_SSH_OPTIONS) + ") are refused.",
                "items": {
                    "type": "string",
                    "allOf": [
                        {
                            "pattern": "^[A-Za-z][A-Za-z0-9]*=[^\\u0000]*[^\\s\\u0000][^\\u0000]*$",
                            "x-expected": '"Key=Value" as for ssh -o (no NUL character)',
                        },
                        {
                            "not": {"pattern": _owned_options_pattern()},
                            "x-error": "this ssh option is set by distlaunch; remove it",
                        },
                    ],
                },
            },
            "python": _text(
                "Interpreter on the host, e.g. a venv's python (program.python is for local "
                "tasks).",
                minLength=1,
                default="python3",
            ),
            "workdir": _optional_text("Remote working dir (default: the login dir).", minLength=1),
            "host_key_checking": {
                "enum": ["yes", "accept-new"],
                "default": "yes",
                "description": "yes: the host key must already be in known_hosts; accept-new: "
                "trust a new host's key once.",
            },
            "connect_timeout_s": {
                "type": "integer",
                "minimum": 1,
                "maximum": 600,
                "default": 10,
                "description": "How long ssh may take to connect.",
            },
        },
        "additionalProperties": False,
        "if": {"required": ["transport"], "properties": {"transport": {"const": "local"}}},
        "then": {
            "properties": {
                key: {"not": {}, "x-error": 'only hosts with "transport": "ssh" take this key'}
                for key in ssh_only
            }
        },
    }


def _task() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "One task of a role: where it runs and what it gets.",
        "properties": {
            "host": {
                "type": "string",
                "pattern": HOST_RE,
                "maxLength": 253,
                "x-expected": "a host name (letters, digits, '.', '-', '_')",
                "default": "localhost",
                "description": 'Host the task runs on: "localhost", "127.0.0.1" or a name from '
                "`hosts` (under Slurm: a node of the allocation, or left out to be placed).",
            },
            "port": {
                "anyOf": [
                    {"const": "auto"},
                    {"type": "integer", "minimum": 1, "maximum": 65535},
                ],
                "x-expected": '"auto" or a port number 1-65535',
                "default": "auto",
                "description": '"auto" or a fixed port number.',
            },
            "gpus": {
                "anyOf": [
                    {"type": "null"},
                    {"type": "integer", "minimum": 0, "maximum": MAX_GPUS},
                    {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": MAX_GPUS - 1},
                        "maxItems": MAX_GPUS,
                        "uniqueItems": True,
                    },
                ],
                "x-expected": f"a GPU count (integer 0-{MAX_GPUS}) or a list of distinct GPU "
                f"indices 0-{MAX_GPUS - 1}",
                "default": None,
                "description": "GPU count or list of GPU indices; none means CPU only "
                "(CUDA_VISIBLE_DEVICES is set so tasks on one host never share a GPU). Under "
                "Slurm only a count.",
            },
            "cpus": {
                "anyOf": [
                    {"enum": ["auto", "all"]},
                    {"type": "integer", "minimum": 1, "maximum": MAX_CPUS},
                    {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": MAX_CPUS - 1},
                        "minItems": 1,
                        "maxItems": MAX_CPUS,
                        "uniqueItems": True,
                    },
                ],
                "x-expected": f'"auto", "all", a CPU count (integer 1-{MAX_CPUS}) or a list of '
                f"distinct CPU ids 0-{MAX_CPUS - 1}",
                "default": "auto",
                "description": 'CPUs the task is pinned to: "auto" (a share of the host\'s), '
                '"all" (no pinning), a count, or a list of CPU ids. Under Slurm only a count, '
                '"auto" or "all".',
            },
        },
        "additionalProperties": False,
    }


def _program() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "What every task runs: a script or a module, with args, env and working "
        "dir.",
        "properties": {
            "script": _optional_text("Python script path (relative: to the spec)."),
            "module": {
                "type": ["string", "null"],
                "pattern": MODULE_RE,
                "x-expected": "a dotted module name",
                "default": None,
                "description": "Python module run with `python -m`.",
            },
            "args": {
                "type": "array",
                "items": {
                    "type": "string",
                    "pattern": NO_NUL,
                    "x-expected": "text without a NUL character",
                },
                "default": [],
                "description": "Arguments every task gets, after the script or module.",
            },
            "env": {
                "type": "object",
                "patternProperties": {
                    "^(?!TF_CONFIG$|DISTLAUNCH_)[^=\\u0000]+$": {
                        "type": "string",
                        "pattern": NO_NUL,
                        "x-expected": "text without a NUL character",
                    }
                },
                "additionalProperties": False,
                "x-key": 'an environment name (not empty, no "=" or NUL character); TF_CONFIG '
                "and DISTLAUNCH_* are set by distlaunch",
                "default": {},
                "description": "Environment variables every task gets.",
            },
            "workdir": _optional_text("Working dir (default: the spec's folder)."),
            "python": _optional_text("Interpreter (default: the launcher's)."),
            "keras": {
                "enum": ["auto", "keras3", "tf_keras"],
                "default": "auto",
                "description": "tf_keras sets TF_USE_LEGACY_KERAS=1 for tf.keras model.fit; auto "
                "picks it for a program whose source uses tf.keras or imports tf_keras and never "
                "imports keras, else keras3.",
            },
        },
        "additionalProperties": False,
        # Exactly one of script and module (after the keys are checked: `if` comes last).
        "if": {"required": ["script"], "properties": {"script": {"type": "string"}}},
        "then": {"properties": {"module": {"type": "null", "x-error": ONE_ENTRY_POINT}}},
        "else": {
            "required": ["module"],
            "properties": {"module": {"type": "string", "x-error": ONE_ENTRY_POINT}},
            "x-error": ONE_ENTRY_POINT,
        },
    }


def _timeouts() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "How long the launcher waits before it calls something failed.",
        "properties": {
            "startup_s": _seconds(
                "Every training task must start its TensorFlow server within this.", 300.0
            ),
            "grace_s": _seconds("SIGTERM to SIGKILL grace period at teardown.", 5.0, zero=True),
            "save_s": _seconds(
                "On a stop notice (SIGTERM or SIGUSR2 to `up`, `distlaunch down`) the tasks save "
                "and stop within this; the rest are then stopped (SIGTERM, grace_s, SIGKILL).",
                30.0,
            ),
            "run_s": _seconds("Fail the whole run after this long.", None),
            "heartbeat_s": _seconds(
                "A task whose distlaunch.worker heartbeat is older than this counts as failed "
                "(it stopped making progress). Off by default.",
                None,
            ),
            "silence_s": _seconds(
                "A task that writes no log output, no heartbeat and uses no CPU for this long is "
                "hung: the stacks of every task are captured, then the restart policy decides. "
                "Works for any program. Off by default.",
                None,
            ),
            "formation_s": _seconds(
                "Once every training task has started its TensorFlow server, the cluster must "
                "form within this: a task that has not connected to the coordination service by "
                "then cannot reach it, and the run fails saying so instead of waiting.",
                60.0,
            ),
            "evaluator_drain_s": _seconds(
                "After training succeeds, how long the evaluator may take to finish.",
                60.0,
                zero=True,
            ),
        },
        "additionalProperties": False,
    }


def _restart() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "When failed tasks are started again, and how often.",
        "properties": {
            "policy": {
                "enum": ["never", "on-failure"],
                "default": "never",
                "description": "never: a failure ends the run. on-failure: restart what the "
                "strategy needs.",
            },
            "max_restarts": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_INT32,
                "default": 3,
                "description": "Automatic restarts allowed (within window_s if set).",
            },
            "backoff": {
                "type": "object",
                "description": "Delay before an automatic restart: initial_s, doubled per recent "
                "restart, at most max_s.",
                "properties": {
                    "initial_s": _seconds("The first delay.", 1.0, zero=True),
                    "max_s": _seconds("The longest delay.", 30.0, zero=True),
                },
                "additionalProperties": False,
                "default": {},
            },
            "window_s": _seconds(
                "Count only restarts this recent against max_restarts (default: the whole run).",
                None,
            ),
            "non_retryable_exit_codes": {
                "type": "array",
                "items": {"type": "integer", "minimum": -MAX_INT32 - 1, "maximum": MAX_INT32},
                "maxItems": 256,
                "default": [2],
                "description": "Exit codes that mean the program is wrong and are never retried "
                "(so are Python's import and syntax errors, read from the task's error file).",
            },
            "standby": {
                "type": "boolean",
                "default": True,
                "description": "With a restart policy, keep one warm standby per local task (an "
                "interpreter that has imported TensorFlow) so that a restart skips the import; "
                "costs its memory.",
            },
        },
        "additionalProperties": False,
    }


def _kubernetes() -> dict[str, Any]:
    def named(pattern: str, expected: str, description: str, **more: Any) -> dict[str, Any]:
        return {
            "type": ["string", "null"],
            "pattern": pattern,
            "x-expected": expected,
            "default": None,
            "description": description,
            **more,
        }

    return {
        "type": "object",
        "description": "Settings of `distlaunch k8s` (the other backends ignore them).",
        "properties": {
            "namespace": named(
                K8S_LABEL, "a DNS label", "Namespace of every object (default: kubectl's)."
            ),
            "image": named(
                IMAGE_REF,
                "an image reference",
                "Image every task runs; it must hold distlaunch and the program (default: "
                "distlaunch:local).",
                maxLength=512,
            ),
            "pvc": named(
                K8S_SUBDOMAIN,
                "a DNS subdomain",
                "PersistentVolumeClaim (ReadWriteMany) mounted as the shared dir; none: a "
                "per-pod emptyDir, lost with the pod.",
                maxLength=253,
            ),
            "ttl_s": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_INT32,
                "default": 86400,
                "description": "ttlSecondsAfterFinished: finished Jobs and their pods go after "
                "this.",
            },
            "cpu": named(
                K8S_QUANTITY,
                'a Kubernetes quantity like "2" or "500m"',
                'CPU of every task (requests and limits), e.g. "2".',
                maxLength=64,
            ),
            "memory": named(
                K8S_QUANTITY,
                'a Kubernetes quantity like "8Gi"',
                'Memory of every task, e.g. "8Gi".',
                maxLength=64,
            ),
        },
        "additionalProperties": False,
        "default": {},
    }


def _strategy_rules() -> dict[str, Any]:
    """Which roles each strategy takes (a role that is null has no task)."""

    def needs(role: str, message: str) -> dict[str, Any]:
        return {
            "required": [role],
            "properties": {role: {"not": {"type": "null"}, "x-error": message}},
            "x-error": message,
        }

    return {
        "if": {"properties": {"strategy": {"const": "multi_worker_mirrored"}}},
        "then": {
            "properties": {
                "tasks": {
                    "anyOf": [
                        {"required": [role], "properties": {role: {"not": {"type": "null"}}}}
                        for role in ("worker", "chief")
                    ],
                    "x-error": "expected at least one worker (or a chief)",
                    "properties": {
                        "ps": {"type": "null", "x-error": "ps tasks need strategy parameter_server"}
                    },
                }
            }
        },
        "else": {
            "properties": {
                "tasks": {
                    "allOf": [
                        needs("ps", "parameter_server needs at least one ps task"),
                        needs("chief", "parameter_server needs a chief (the coordinator)"),
                        needs("worker", "parameter_server needs at least one worker"),
                    ]
                }
            }
        },
    }


def document() -> dict[str, Any]:
    """The schema document (the backend's names are a string here: `published` lists them)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "distlaunch cluster spec",
        "description": "A whole cluster spec as the user writes it (JSON, or YAML 1.2); relative "
        "paths are relative to the spec file's folder.",
        "type": "object",
        "$defs": {
            "host": _host(),
            "task": _task(),
            "role": _role(MAX_TASKS),
            "one_task_role": _role(1),
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
            "program": _program(),
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
                **_text(
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
            "timeouts": {**_timeouts(), "default": {}},
            "restart": {**_restart(), "default": {}},
            "host_template": {
                "$ref": "#/$defs/host",
                "description": "Settings every host of `hostfile` starts from (user, python, ...).",
            },
            "hostfile": {
                **_optional_text(
                    "A host file (relative: to the spec), one SSH host per line as `node1 "
                    "slots=4`; its hosts join `hosts` with host_template's settings. slots caps "
                    "per_host.",
                    minLength=1,
                ),
            },
            "hosts": {
                "type": "object",
                "patternProperties": {
                    # (?!.*\n): a name-pattern's "$" is Python's here (no newline before it).
                    "^(?!.*\\n)(?!localhost$|127\\.0\\.0\\.1$)[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}$": {
                        "$ref": "#/$defs/host"
                    }
                },
                "additionalProperties": False,
                "x-key": "a host name (letters, digits, '.', '-', '_'; not localhost or "
                "127.0.0.1; at most 253 characters)",
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
            "kubernetes": _kubernetes(),
        },
        "required": ["name", "strategy", "program", "tasks"],
        "additionalProperties": False,
        # The strategy's roles (after the keys are checked: `if` comes last).
        **_strategy_rules(),
    }


def published(backend_names: tuple[str, ...]) -> dict[str, Any]:
    """The schema `distlaunch schema` prints: the document with the installed backends listed."""
    out = document()
    out["properties"]["backend"]["enum"] = list(backend_names)
    return out
