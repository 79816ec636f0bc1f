"""Where a raw spec comes from before it is validated: a YAML file, `--set` overrides, a host
file, the `per_host` shorthand and the `--hosts`/`--exclude` filters.

Each step turns plain data into plain data (dicts and lists as JSON would give them), so that
spec.py validates one shape whatever the user wrote. Problems are SpecErrors that name the
file, the JSON path and, where it is known, the line.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distlaunch.launcher.errors import SpecError, UsageError

# yaml is imported by what reads YAML (a .yaml spec, a --set value): a JSON spec's start skips it.
if TYPE_CHECKING:
    import yaml

# A YAML spec may expand to at most this many nodes: anchors and aliases can otherwise make a
# small file expand exponentially ("billion laughs").
MAX_NODES = 200_000
# Keys a host-file line may set after its name (`node1 slots=4`).
HOSTFILE_KEYS = ("slots",)


@dataclass(frozen=True)
class SpecOptions:
    """What the command line changes in a spec: overrides and host filters."""

    overrides: tuple[str, ...] = ()  # "key.path=value", applied in order
    only_hosts: tuple[str, ...] = ()  # --hosts: keep only these hosts (empty: all)
    exclude_hosts: tuple[str, ...] = ()  # --exclude: drop these hosts


@dataclass
class Source:
    """A raw spec and what is known about where its values were written."""

    raw: Any
    file: str  # the spec file as the user named it
    # JSON path ("$.tasks.worker.count") -> 1-based line in the file (YAML only).
    lines: dict[str, int] = field(default_factory=dict)
    # JSON path -> the `--set` that wrote it.
    overridden: dict[str, str] = field(default_factory=dict)

    def locate(self, error: SpecError) -> SpecError:
        """``error`` with the line of its JSON path (or the nearest enclosing one) and the
        override that set the value, when known."""
        path = error.json_path
        if error.file != self.file:  # an error in a host file names its own line
            return error
        # A task of a role that per_host spread is written once, as the role's settings.
        paths = (path, re.sub(r"^(\$\.tasks\.[A-Za-z]+)\[\d+\]", r"\1", path))
        line = None
        probe = paths[1] if paths[1] != path and paths[1] in self.lines else path
        while probe:
            if probe in self.lines:
                line = self.lines[probe]
                break
            probe = _parent(probe)
        message = error.message
        for target, override in self.overridden.items():
            if any(p == target or p.startswith((target + ".", target + "[")) for p in paths):
                message += f" (set by --set {override})"
                break
        if line is None and message == error.message:
            return error
        file = f"{error.file}:{line}" if line is not None else error.file
        return SpecError(file, path, message)


def _parent(path: str) -> str:
    """The JSON path one level up ("" above "$")."""
    if path == "$":
        return ""
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else "$"


def json_path(loc: Iterable[str | int]) -> str:
    """``("tasks", "worker", 0)`` as ``$.tasks.worker[0]``."""
    out = "$"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


@functools.cache
def _loader() -> type[yaml.SafeLoader]:
    """SafeLoader with YAML 1.2 booleans: only true/false are booleans. YAML 1.1 also reads
    yes/no/on/off as booleans, which would turn `host_key_checking: yes` into true."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool",
        re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
        list("tTfF"),
    )
    return Loader


def read_yaml(text: str, shown: str) -> Source:
    """Parse a YAML spec into plain data, with the line of every value; SpecError on a syntax
    error, a duplicate key, a non-string key or a file that expands too far."""
    import yaml

    loader = _loader()(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{shown}:{mark.line + 1}" if mark else shown
        raise SpecError(where, "$", f"invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise SpecError(shown, "$", f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if node is None:
        raise SpecError(shown, "$", "expected a mapping (the file is empty)")
    source = Source(raw=None, file=shown)
    budget = [MAX_NODES]
    source.raw = _plain(loader, node, (), source.lines, budget, shown)
    return source


def _plain(
    loader: yaml.SafeLoader,
    node: yaml.Node,
    loc: tuple[str | int, ...],
    lines: dict[str, int],
    budget: list[int],
    shown: str,
    mark: yaml.Mark | None = None,
) -> Any:
    """The data of ``node``, recording each path's line (``mark``: where its key is written)."""
    import yaml

    budget[0] -= 1
    path = json_path(loc)
    if budget[0] < 0:
        raise SpecError(shown, path, f"expected at most {MAX_NODES} values (aliases expand)")
    lines.setdefault(path, (mark or node.start_mark).line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node)
            if not isinstance(key, str):
                raise SpecError(
                    f"{shown}:{key_node.start_mark.line + 1}",
                    path,
                    f"expected string keys, got {key!r}",
                )
            if key in out:
                raise SpecError(
                    f"{shown}:{key_node.start_mark.line + 1}",
                    json_path((*loc, key)),
                    f"key {key!r} appears twice; expected it once",
                )
            out[key] = _plain(
                loader,
                value_node,
                (*loc, key),
                lines,
                budget,
                shown,
                key_node.start_mark,
            )
        return out
    if isinstance(node, yaml.SequenceNode):
        return [
            _plain(loader, child, (*loc, i), lines, budget, shown)
            for i, child in enumerate(node.value)
        ]
    value = loader.construct_object(node)
    if not isinstance(value, (str, int, float, bool, type(None))):
        # A timestamp or binary: no spec value is one; say so as a string at its path.
        return str(value)
    return value


def parse_override(text: str) -> tuple[tuple[str | int, ...], Any]:
    """Split ``key.path=value`` into path parts and a value read as a YAML/JSON scalar or list;
    UsageError when it is not of that form."""
    key, sep, value_text = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(re.fullmatch(r"[A-Za-z0-9_.-]+", p) for p in parts):
        raise UsageError(f"--set {text!r}: expected KEY.PATH=VALUE, e.g. tasks.worker.count=4")
    import yaml

    try:
        value = yaml.load(value_text, Loader=_loader()) if value_text.strip() else ""
    except yaml.YAMLError as exc:
        raise UsageError(f"--set {text}: the value is not valid YAML/JSON: {exc}") from None
    loc = tuple(int(p) if p.isdigit() else p for p in parts)
    return loc, value


def apply_overrides(source: Source, overrides: Iterable[str], shown: str) -> None:
    """Write each ``key.path=value`` into the raw spec, creating objects on the way."""
    for text in overrides:
        loc, value = parse_override(text)
        node = source.raw
        for i, part in enumerate(loc[:-1]):
            nxt = loc[i + 1]
            if isinstance(node, dict) and isinstance(part, str):
                if not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                raise SpecError(
                    shown,
                    json_path(loc[: i + 1]),
                    f"--set {text}: cannot set a key here ({_kind(node)} in the spec)",
                ) from None
            if isinstance(nxt, int) and not isinstance(node, list):
                raise SpecError(
                    shown,
                    json_path(loc[: i + 1]),
                    f"--set {text}: expected a list to index",
                )
        last = loc[-1]
        in_list = isinstance(node, list) and isinstance(last, int) and last < len(node)
        if in_list or (isinstance(node, dict) and isinstance(last, str)):
            node[last] = value
        else:
            raise SpecError(shown, json_path(loc), f"--set {text}: no such place in the spec")
        source.overridden[json_path(loc)] = text


def _kind(node: Any) -> str:
    return "a list" if isinstance(node, list) else "a value" if node is not None else "nothing"


def read_hostfile(path: Path, shown: str) -> list[tuple[str, int | None, int]]:
    """The hosts of a host file: (name, slots or None, line) per line like ``node1 slots=4``.

    Blank lines and ``#`` comments are skipped, as by DeepSpeed and MPI host files.
    """
    try:
        text = path.read_text(encoding="utf-8")
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
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or len(name) > 253:
            raise SpecError(
                where,
                "$.hostfile",
                f"expected a host name or IPv4 address, got {name!r}",
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
                    f"expected slots=N after the host name, got {word!r}",
                )
            if not value.isdigit() or int(value) < 1:
                raise SpecError(
                    where,
                    "$.hostfile",
                    f"expected slots to be an integer >= 1, got {value!r}",
                )
            slots = int(value)
        out.append((name, slots, number))
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
                    f"$.hosts.{name}",
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
            if isinstance(entry, dict) and entry.get("host") in dropped:
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
    over the spec's hosts in order (C defaults to N per host)."""
    tasks = raw.get("tasks")
    if not isinstance(tasks, dict):
        return
    for role, group in tasks.items():
        if not isinstance(group, dict) or "per_host" not in group:
            continue
        per_host = group["per_host"]
        if not isinstance(per_host, int) or isinstance(per_host, bool) or per_host < 1:
            raise SpecError(
                shown,
                f"$.tasks.{role}.per_host",
                f"expected an integer >= 1, got {per_host!r}",
            )
        if "host" in group:
            raise SpecError(
                shown,
                f"$.tasks.{role}.host",
                "per_host spreads tasks over `hosts`; remove host",
            )
        hosts = raw.get("hosts")
        names = list(hosts) if isinstance(hosts, dict) else []
        if not names:
            raise SpecError(
                shown,
                f"$.tasks.{role}.per_host",
                "per_host needs hosts (`hosts` or `hostfile`)",
            )
        for name in names:
            if slots.get(name, per_host) < per_host:
                raise SpecError(
                    shown,
                    f"$.tasks.{role}.per_host",
                    f"host {name!r} has slots={slots[name]} in the host file; "
                    "expected per_host <= slots",
                )
        count = group.get("count", per_host * len(names))
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise SpecError(
                shown,
                f"$.tasks.{role}.count",
                f"expected an integer >= 1, got {count!r}",
            )
        if count > per_host * len(names):
            raise SpecError(
                shown,
                f"$.tasks.{role}.count",
                f"{count} tasks do not fit on {len(names)} hosts with per_host {per_host}",
            )
        if count > 1 and isinstance(group.get("port"), int):
            raise SpecError(
                shown, f"$.tasks.{role}.port", 'a fixed port needs one task; use "auto"'
            )
        shared = {k: v for k, v in group.items() if k not in ("count", "per_host")}
        tasks[role] = [{**shared, "host": names[i // per_host]} for i in range(count)]
