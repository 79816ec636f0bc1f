"""The schema of what a run does and how it ends: the program, its timeouts, the restart policy,
an elastic run's range, Kubernetes output, and the roles each strategy needs.

Parts of spec/schema.py's document: that module assembles them; the limits and patterns come
from spec/rules.py.
"""

from __future__ import annotations

from typing import Any

from distlaunch.launcher.spec.rules import (
    ELASTIC_WORKERS,
    ELASTIC_WORKERS_EXPECTED,
    IMAGE_REF,
    K8S_LABEL,
    K8S_QUANTITY,
    K8S_SUBDOMAIN,
    MAX_INT32,
    MAX_TASKS,
    MODULE_RE,
    NO_NUL,
    ONE_ENTRY_POINT,
    optional_text,
    seconds,
)


def program() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "What every task runs: a script or a module, with args, env and working "
        "dir.",
        "properties": {
            "script": optional_text("Python script path (relative: to the spec)."),
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
            "workdir": optional_text("Working dir (default: the spec's folder)."),
            "python": optional_text("Interpreter (default: the launcher's)."),
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


def timeouts() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "How long the launcher waits before it calls something failed.",
        "properties": {
            "startup_s": seconds(
                "Every training task must start its TensorFlow server within this (null: no "
                "deadline).",
                300.0,
                nullable=True,
            ),
            "grace_s": seconds("SIGTERM to SIGKILL grace period at teardown.", 5.0, zero=True),
            "save_s": seconds(
                "On a stop notice (SIGTERM or SIGUSR2 to `up`, `distlaunch down`) the tasks save "
                "and stop within this; the rest are then stopped (SIGTERM, grace_s, SIGKILL).",
                30.0,
            ),
            "run_s": seconds("Fail the whole run after this long.", None),
            "heartbeat_s": seconds(
                "A task whose distlaunch.worker heartbeat is older than this counts as failed "
                "(it stopped making progress). Off by default.",
                None,
            ),
            "silence_s": seconds(
                "A task that writes no log output, no heartbeat and uses no CPU for this long is "
                "hung: the stacks of every task are captured, then the restart policy decides. "
                "Works for any program. Off by default.",
                None,
            ),
            "formation_s": seconds(
                "Once every training task has started its TensorFlow server, the cluster must "
                "form within this: a task that has not connected to the coordination service by "
                "then cannot reach it, and the run fails saying so instead of waiting.",
                60.0,
            ),
            "evaluator_drain_s": seconds(
                "After training succeeds, how long the evaluator may take to finish.",
                60.0,
                zero=True,
            ),
        },
        "additionalProperties": False,
    }


def restart() -> dict[str, Any]:
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
                    "initial_s": seconds("The first delay.", 1.0, zero=True),
                    "max_s": seconds("The longest delay.", 30.0, zero=True),
                },
                "additionalProperties": False,
                "default": {},
            },
            "window_s": seconds(
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


def elastic() -> dict[str, Any]:
    """An elastic run: the worker role's tasks are the slots a world is chosen from."""
    return {
        "type": "object",
        "description": "An elastic run: how many workers it may have. The worker role's tasks "
        "are the slots it may use; the run starts on the first MAX of them, shrinks from its "
        "latest checkpoint when a host is lost (down to MIN) and grows back when one returns "
        "(up to MAX). The local backend (SSH hosts) and Slurm resize; compose and the "
        "Kubernetes manifests do not.",
        "properties": {
            "workers": {
                # anyOf: a number (`workers: 3`) is answered with the range's words too.
                "anyOf": [{"type": "string", "pattern": ELASTIC_WORKERS}],
                "x-expected": ELASTIC_WORKERS_EXPECTED,
                "description": 'The range of workers, as torchrun\'s --nnodes: "MIN:MAX", or '
                '"MIN:" for MAX = the worker role\'s task count. MIN >= 1; MAX at most the '
                "worker role's tasks.",
            },
            "sizes": {
                "type": ["array", "null"],
                "items": {"type": "integer", "minimum": 1, "maximum": MAX_TASKS},
                "minItems": 1,
                "maxItems": MAX_TASKS,
                "uniqueItems": True,
                "default": None,
                "description": "The world sizes the program accepts (a batch that must divide "
                "evenly); others in the range are skipped, with a line. null: every size in "
                "the range.",
            },
            "batch": {
                "enum": ["global", "per_worker"],
                "default": "global",
                "description": "global: the global batch stays at every world size (per-worker "
                "batch = global / workers). per_worker: the per-worker batch stays (global = "
                "per-worker * workers).",
            },
            "resizes": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_INT32,
                "default": 10,
                "description": "Resizes allowed (membership changes); restart.max_restarts "
                "stays the budget of failures.",
            },
            "lost_after_s": seconds(
                "A host whose agent is gone and that answers no probe for this long is lost.",
                10.0,
            ),
            "settle_s": seconds(
                "After a loss, wait this long for more news before resizing (skipped when "
                "nothing more can change).",
                10.0,
                zero=True,
            ),
            "interval_s": seconds("At most one resize per this many seconds.", 30.0, zero=True),
            "cooldown_s": seconds(
                "A host that failed is held out this long before it may rejoin, doubled at each "
                "failure.",
                30.0,
                zero=True,
            ),
            "cooldown_max_s": seconds("The longest a host is held out.", 600.0, zero=True),
            "probe_s": seconds("How often lost and held-out hosts are probed to come back.", 5.0),
        },
        "required": ["workers"],
        "additionalProperties": False,
    }


def kubernetes() -> dict[str, Any]:
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


def strategy_rules() -> dict[str, Any]:
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
