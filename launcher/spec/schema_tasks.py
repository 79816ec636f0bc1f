"""The schema of where tasks run: a role's tasks, one task, and the hosts tasks are placed on.

Parts of spec/schema.py's document (its ``$defs``): that module assembles them; the limits and
patterns come from spec/rules.py.
"""

from __future__ import annotations

from typing import Any

from distlaunch.launcher.spec.rules import (
    HOST_RE,
    MAX_CPUS,
    MAX_GPUS,
    OWNED_SSH_OPTIONS,
    TASK_KEYS,
    optional_text,
    text,
)


def _owned_options_pattern() -> str:
    """ssh -o keys distlaunch owns, any case (ssh reads them so): no inline flags in ECMA."""
    words = "|".join(
        "".join(f"[{c.upper()}{c.lower()}]" for c in option) for option in OWNED_SSH_OPTIONS
    )
    return f"^({words})="


def role(max_tasks: int) -> dict[str, Any]:
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


def host() -> dict[str, Any]:
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
            "identity_file": optional_text("SSH private key (relative: to the spec).", minLength=1),
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
            "python": text(
                "Interpreter on the host, e.g. a venv's python (program.python is for local "
                "tasks).",
                minLength=1,
                default="python3",
            ),
            "workdir": optional_text("Remote working dir (default: the login dir).", minLength=1),
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


def task() -> dict[str, Any]:
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
