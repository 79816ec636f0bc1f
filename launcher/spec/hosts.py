"""A spec's hosts before the typed model is built: the host file read into `hosts`, the
`--hosts`/`--exclude` filters, and `per_host` roles spread over the hosts into task lists.

Plain data in, plain data out (spec/model.py validates the result). A host file's entries pass
the same name rule as the spec's `hosts` keys (spec/rules.py's HOST_KEY): the schema never sees
them, since they join `hosts` after it ran. Problems are SpecErrors naming the file and line.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distlaunch.launcher.core.errors import SpecError, UsageError
from distlaunch.launcher.spec.invalid import json_path
from distlaunch.launcher.spec.rules import HOST_KEY, HOST_KEY_EXPECTED, MAX_TASKS
from distlaunch.launcher.spec.sources import Source, SpecOptions, preview

MAX_HOSTFILE_BYTES = 1 << 20
# Keys a host-file line may set after its name (`node1 slots=4`).
HOSTFILE_KEYS = ("slots",)
_HOST_KEY = re.compile(HOST_KEY)


def read_hostfile(path: Path, shown: str) -> list[tuple[str, int | None, int]]:
    """The hosts of a host file: (name, slots or None, line) per line like ``node1 slots=4``.

    Blank lines and ``#`` comments are skipped, as by DeepSpeed and MPI host files.
    """
    try:
        with path.open("rb") as stream:
            data = stream.read(MAX_HOSTFILE_BYTES + 1)
        if len(data) > MAX_HOSTFILE_BYTES:
            raise SpecError(
                shown,
                "$.hostfile",
                f"host file {str(path)!r}: expected at most {MAX_HOSTFILE_BYTES >> 20} MiB",
            )
        text = data.decode("utf-8")
    except OSError as exc:
        raise SpecError(
            shown, "$.hostfile", f"cannot read host file {str(path)!r}: {exc.strerror}"
        ) from None
    except UnicodeDecodeError:
        raise SpecError(shown, "$.hostfile", f"host file {str(path)!r} is not UTF-8 text") from None
    out: list[tuple[str, int | None, int]] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}:{number}"
        name, slots = words[0], None
        # The rule of the spec's `hosts` keys: these names join `hosts` after the schema ran.
        if not _HOST_KEY.fullmatch(name):
            raise SpecError(
                where, "$.hostfile", f"expected {HOST_KEY_EXPECTED}, got {preview(name)}"
            )
        if name in seen:
            raise SpecError(where, "$.hostfile", f"host {name!r} appears twice; expected it once")
        seen.add(name)
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if key not in HOSTFILE_KEYS or not sep:
                raise SpecError(
                    where,
                    "$.hostfile",
                    f"expected slots=N after the host name, got {preview(word)}",
                )
            # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
            if not re.fullmatch(r"[0-9]{1,9}", value) or int(value) < 1:
                raise SpecError(
                    where,
                    "$.hostfile",
                    f"expected slots to be an integer >= 1, got {preview(value)}",
                )
            slots = int(value)
        out.append((name, slots, number))
        if len(out) > MAX_TASKS:
            raise SpecError(where, "$.hostfile", f"expected at most {MAX_TASKS} hosts")
    if not out:
        raise SpecError(shown, "$.hostfile", f"host file {str(path)!r} names no host")
    return out


def expand(source: Source, base: Path, shown: str, options: SpecOptions) -> dict[str, int]:
    """Expand the host file into ``hosts``, filter hosts, and spread ``per_host`` roles.

    Returns the slots of each host-file host. Leaves a raw spec that lacks the keys alone.
    """
    raw = source.raw
    if not isinstance(raw, dict):
        return {}
    slots: dict[str, int] = {}
    hostfile = raw.get("hostfile")
    if hostfile is not None:
        if not isinstance(hostfile, str) or not hostfile:
            raise SpecError(
                shown,
                "$.hostfile",
                "expected the path of a host file (relative: to the spec)",
            )
        template = raw.get("host_template", {})
        if not isinstance(template, dict):
            raise SpecError(shown, "$.host_template", "expected an object of host settings")
        hosts = raw.setdefault("hosts", {})
        if not isinstance(hosts, dict):
            return {}  # validation names it
        path = base / Path(hostfile).expanduser()
        for name, count, number in read_hostfile(path, shown):
            if name in hosts:
                raise SpecError(
                    f"{path}:{number}",
                    json_path(("hosts", name)),
                    "host is also in the spec's hosts; keep one",
                )
            hosts[name] = copy.deepcopy(template)
            if count is not None:
                slots[name] = count
    _filter_hosts(raw, shown, options)
    _spread(raw, shown, slots)
    return slots


def _filter_hosts(raw: dict[str, Any], shown: str, options: SpecOptions) -> None:
    """Apply --hosts and --exclude to ``hosts``; a task placed on a dropped host is an error."""
    if not (options.only_hosts or options.exclude_hosts):
        return
    hosts = raw.get("hosts")
    hosts = hosts if isinstance(hosts, dict) else {}
    for flag, names in (
        ("--hosts", options.only_hosts),
        ("--exclude", options.exclude_hosts),
    ):
        for name in names:
            if name not in hosts:
                known = ", ".join(hosts) or "none"
                raise UsageError(
                    f"{flag} {name}: no such host in {shown}; expected one of: {known}"
                )
    keep = set(options.only_hosts) if options.only_hosts else set(hosts)
    keep -= set(options.exclude_hosts)
    if not keep:
        raise UsageError("--hosts/--exclude leave no host to run on")
    dropped = set(hosts) - keep
    raw["hosts"] = {name: value for name, value in hosts.items() if name in keep}
    tasks = raw.get("tasks")
    for role, group in tasks.items() if isinstance(tasks, dict) else ():
        entries = group if isinstance(group, list) else [group]
        for i, entry in enumerate(entries):
            host = entry.get("host") if isinstance(entry, dict) else None
            if isinstance(host, str) and host in dropped:
                where = json_path(
                    ("tasks", role, i, "host")
                    if isinstance(group, list)
                    else ("tasks", role, "host")
                )
                raise SpecError(
                    shown,
                    where,
                    f"host {entry['host']!r} is left out by --hosts/--exclude",
                )


def _spread(raw: dict[str, Any], shown: str, slots: Mapping[str, int]) -> None:
    """Turn each ``{"per_host": N, "count": C, ...}`` role into a list of C tasks, N per host,
    over the spec's hosts in order (C defaults to N per host). The data is valid (the schema
    checked it); how many tasks it makes is checked before any is made."""
    tasks = raw.get("tasks")
    if not isinstance(tasks, dict):
        return
    for role, group in tasks.items():
        if not isinstance(group, dict) or "per_host" not in group:
            continue
        where = json_path(("tasks", role))
        per_host = int(group["per_host"])
        hosts = raw.get("hosts")
        names = list(hosts) if isinstance(hosts, dict) else []
        if not names:
            raise SpecError(
                shown, f"{where}.per_host", "per_host needs hosts (`hosts` or `hostfile`)"
            )
        for name in names:
            if slots.get(name, per_host) < per_host:
                raise SpecError(
                    shown,
                    f"{where}.per_host",
                    f"host {name!r} has slots={slots[name]} in the host file; "
                    "expected per_host <= slots",
                )
        room = per_host * len(names)
        if "count" not in group and room > MAX_TASKS:
            raise SpecError(
                shown,
                f"{where}.per_host",
                f"per_host {per_host} on {len(names)} hosts makes {room} tasks; expected at "
                f"most {MAX_TASKS}",
            )
        count = int(group.get("count", room))
        if count > room:
            raise SpecError(
                shown,
                f"{where}.count",
                f"{count} tasks do not fit on {len(names)} hosts with per_host {per_host}",
            )
        if count > 1 and isinstance(group.get("port"), int | float):
            raise SpecError(shown, f"{where}.port", 'a fixed port needs one task; use "auto"')
        shared = {k: v for k, v in group.items() if k not in ("count", "per_host")}
        tasks[role] = [{**shared, "host": names[i // per_host]} for i in range(count)]
