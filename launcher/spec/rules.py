"""The values and patterns the spec's rules are made of, read by the schema and by the checks in code.

One place for each limit and pattern: spec/schema.py states them to users and validators, and
spec/model.py's cross-field checks and the backends read the same names, so the two cannot drift.
The small builders at the end make the schema's recurring value shapes (text passed to a process,
a duration in seconds).
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
# A name in `hosts` (a key of the spec's map, or a host file's line): this machine is never one,
# it needs no entry. (?!.*\n): a key pattern's "$" is Python's in the checker (no newline before it).
HOST_KEY = "^(?!.*\\n)(?!localhost$|127\\.0\\.0\\.1$)[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}$"
HOST_KEY_EXPECTED = (
    "a host name (letters, digits, '.', '-', '_'; not localhost or 127.0.0.1; at most 253 "
    "characters)"
)
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
# An elastic run's worker range, as torchrun's --nnodes: "MIN:MAX", or "MIN:" (MAX: the worker
# role's tasks). (?!.*\n): "$" is Python's in jsonschema (it passes a newline before it).
ELASTIC_WORKERS = r"^(?!.*\n)([1-9][0-9]{0,3}):([1-9][0-9]{0,3})?$"
ELASTIC_WORKERS_EXPECTED = 'a range "MIN:MAX" or "MIN:" of worker counts (MIN >= 1), like "2:3"'

TASK_KEYS = ("host", "port", "gpus", "cpus")
ONE_ENTRY_POINT = 'expected exactly one of "script" or "module"'


def text(description: str, **more: Any) -> dict[str, Any]:
    """A string passed to a process."""
    return {
        "type": "string",
        "pattern": NO_NUL,
        "x-expected": "text without a NUL character",
        "description": description,
        **more,
    }


def optional_text(description: str, **more: Any) -> dict[str, Any]:
    return {**text(description, **more), "type": ["string", "null"], "default": None}


def seconds(
    description: str, default: float | None, *, zero: bool = False, nullable: bool = False
) -> dict[str, Any]:
    """A duration in seconds; null (no limit) allowed where the default is null or ``nullable``."""
    low = {"minimum": 0} if zero else {"exclusiveMinimum": 0}
    return {
        "type": "number" if default is not None and not nullable else ["number", "null"],
        **low,
        "maximum": MAX_INT32,
        "default": default,
        "description": description,
    }
