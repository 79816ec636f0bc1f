"""Where a raw spec comes from before it is validated: a YAML file and `--set` overrides (the
host file, `per_host` and the `--hosts`/`--exclude` filters are spec/hosts.py's).

Each step turns plain data into plain data (dicts and lists as JSON would give them), so that
spec/model.py validates one shape whatever the user wrote. Problems are SpecErrors that name the
file, the JSON path and, where it is known, the line.
"""

from __future__ import annotations

import functools
import json
import math
import re
import reprlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from distlaunch.launcher.core.errors import SpecError, UsageError
from distlaunch.launcher.spec.invalid import json_path, short_path

# Bounds on what a YAML spec or a `--set` value may cost before anything reads it as a spec:
# anchors and aliases can otherwise make a small text expand exponentially ("billion laughs").
MAX_YAML_BYTES = 1 << 20  # the text, checked before parsing
MAX_OVERRIDE_BYTES = 64 << 10  # one `--set` value
MAX_NODES = 200_000  # nodes composed, and values once aliases expand
# Bytes once aliases expand: every value's JSON path (a spec file keeps one per value, for its
# line) and string, counted at each place an alias puts it.
MAX_EXPANDED_BYTES = 16 << 20
# No spec key is longer; a longer one would flood the error that names it.
MAX_KEY_CHARS = 256


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
            if any(_within(p, target) or _within(target, p) for p in paths):
                message += f" (set by --set {override})"
                break
        if line is None and message == error.message:
            return error
        file = f"{error.file}:{line}" if line is not None else error.file
        return SpecError(file, path, message)


def _within(path: str, outer: str) -> bool:
    """Whether JSON path ``path`` is ``outer`` or inside it."""
    return path == outer or path.startswith((outer + ".", outer + "["))


def _parent(path: str) -> str:
    """The JSON path one level up ("" above "$")."""
    if path == "$":
        return ""
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else "$"


class _TooBig(Exception):
    """The YAML text composes to more than MAX_NODES nodes."""


# YAML 1.2's core schema: how a plain (unquoted, untagged) scalar is read. Everything else is a
# string: 1.1's octal 010, sexagesimal 1:30:00, yes/no and timestamps are not read as numbers,
# booleans or dates (a spec means the text it shows).
_NULL = re.compile(r"(?:~|null|Null|NULL|)")
_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_INT = re.compile(r"[-+]?[0-9]+")
_INT_OCT = re.compile(r"0o[0-7]+")
_INT_HEX = re.compile(r"0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")
_INF = re.compile(r"[-+]?\.(?:inf|Inf|INF)")
_NAN = re.compile(r"\.(?:nan|NaN|NAN)")
# An integer literal longer than this is no number a spec needs (Python refuses to convert one
# over 4300 digits).
MAX_INT_DIGITS = 100
_CORE = "tag:yaml.org,2002:"
_PLAIN = "?plain"  # the tag our resolver gives an untagged plain scalar


@functools.cache
def _yaml() -> Any:
    """What makes a ruamel.yaml reader that composes nodes (made on first use, with ruamel's
    import: a JSON spec's start skips it); scalars are read by `_scalar`, not by ruamel's
    resolver. A new reader per text: one that stopped at an error keeps its nesting depth."""
    from ruamel.yaml import YAML
    from ruamel.yaml.composer import Composer
    from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode
    from ruamel.yaml.resolver import VersionedResolver
    from ruamel.yaml.tag import Tag

    class Resolver(VersionedResolver):
        """Marks what was written without a tag; `_scalar` reads it as YAML 1.2 core."""

        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            """The tag of an untagged node."""
            if kind is SequenceNode:
                return Tag(suffix=_CORE + "seq")
            if kind is MappingNode:
                return Tag(suffix=_CORE + "map")
            if kind is ScalarNode and implicit[0]:
                return Tag(suffix=_PLAIN)
            return Tag(suffix=_CORE + "str")

    class Counting(Composer):
        """Stops composing after MAX_NODES nodes (an alias adds none: it is the anchored node
        again; what aliases expand to is counted by `_Expander`)."""

        def __init__(self, loader: Any = None) -> None:
            super().__init__(loader)
            self.warn_double_anchors = False  # a later anchor of one name wins, as YAML says
            self.composed = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            """Compose the next node, counting it."""
            self.composed += 1
            if self.composed > MAX_NODES:
                raise _TooBig
            return super().compose_node(parent, index)

    def reader() -> Any:
        made = YAML(typ="safe", pure=True)
        made.Resolver = Resolver
        made.Composer = Counting
        made.max_depth = MAX_DEPTH
        return made

    return reader


MAX_DEPTH = 64  # nesting of lists and mappings; a spec has 5 levels


def read_yaml(text: str, shown: str) -> Source:
    """Parse a YAML 1.2 spec into plain data, with the line of every value; SpecError on a
    syntax error, a duplicate key, a non-string or overlong key, a tag or a merge key, or a
    text that is or expands too big."""
    if len(text) > MAX_YAML_BYTES or len(text.encode()) > MAX_YAML_BYTES:
        size = len(text.encode())
        raise SpecError(shown, "$", f"expected a YAML spec of at most 1 MiB, got {size} bytes")
    node = _compose(text, shown)
    if node is None:
        raise SpecError(shown, "$", "expected a mapping (the file is empty)")
    source = Source(raw=None, file=shown)
    source.raw = _Expander(shown, source.lines).plain(node, ())
    return source


_VERSION = re.compile(r"^%YAML[ \t]+([^\s#]+)", re.MULTILINE)


def _compose(text: str, shown: str) -> Any:
    """The node tree of ``text`` (aliases still shared); SpecError on a syntax error, a YAML
    version other than 1.2 or too many nodes."""
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    version = _VERSION.search(text)
    if version and version.group(1) != "1.2":
        line = text.count("\n", 0, version.start()) + 1
        raise SpecError(
            f"{shown}:{line}", "$", f"expected YAML 1.2, got %YAML {cut(version.group(1), 20)}"
        )
    try:
        return _yaml()().compose(text)
    except _TooBig:
        raise SpecError(shown, "$", f"expected at most {MAX_NODES} YAML nodes") from None
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{shown}:{mark.line + 1}" if mark else shown
        raise SpecError(
            where, "$", f"invalid YAML: {_problem(exc.problem or exc.context)}"
        ) from None
    except (YAMLError, ValueError) as exc:
        # ruamel's own checks (a %TAG it cannot use...) say what they found in their words.
        raise SpecError(shown, "$", f"invalid YAML: {_problem(str(exc))}") from None


def _problem(text: str | None) -> str:
    """ruamel's description of a syntax error, as one readable line."""
    words = " ".join((text or "not valid YAML").split())
    # The end of the text is a NUL to the scanner: say what it means.
    words = words.replace("'\\x00'", "the end of the text").replace("'\\0'", "the end of the text")
    return cut(words, 120)


class _Expander:
    """Turns a YAML node tree into plain data, expanding aliases within MAX_NODES values and
    MAX_EXPANDED_BYTES, and records the line of every JSON path in ``lines``."""

    def __init__(self, shown: str, lines: dict[str, int]) -> None:
        self.shown = shown
        self.lines = lines
        self.nodes = MAX_NODES
        self.bytes = MAX_EXPANDED_BYTES

    def plain(self, node: Any, loc: tuple[str | int, ...], mark: Any = None) -> Any:
        """The data of ``node`` at ``loc`` (``mark``: where its key is written)."""
        path = json_path(loc)
        self.nodes -= 1
        self.bytes -= len(path) + (len(node.value) if isinstance(node.value, str) else 0)
        where = f"{self.shown}:{node.start_mark.line + 1}"
        if self.nodes < 0 or self.bytes < 0:
            raise SpecError(
                where,
                short_path(path),
                f"expected at most {MAX_NODES} values and {MAX_EXPANDED_BYTES >> 20} MiB "
                "once aliases expand",
            )
        self.lines.setdefault(path, (mark or node.start_mark).line + 1)
        tag = str(node.tag)
        if node.id == "mapping":
            self._tagged(tag, "map", where, path)
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = self._key(key_node, loc)
                if key in out:
                    raise SpecError(
                        f"{self.shown}:{key_node.start_mark.line + 1}",
                        short_path(json_path((*loc, key))),
                        f"key {preview(key)} appears twice; expected it once",
                    )
                out[key] = self.plain(value_node, (*loc, key), key_node.start_mark)
            return out
        if node.id == "sequence":
            self._tagged(tag, "seq", where, path)
            return [self.plain(child, (*loc, i)) for i, child in enumerate(node.value)]
        return _scalar(tag, node.value, where, short_path(path))

    def _tagged(self, tag: str, kind: str, where: str, path: str) -> None:
        if tag != _CORE + kind:
            raise SpecError(where, short_path(path), _unsupported(tag))

    def _key(self, node: Any, loc: tuple[str | int, ...]) -> str:
        """The string a key node holds; SpecError for any other key or an overlong one."""
        where = f"{self.shown}:{node.start_mark.line + 1}"
        path = short_path(json_path(loc))
        if node.id != "scalar":  # never constructed: it may be an alias tree
            raise SpecError(where, path, f"expected string keys, got a {node.id}")
        key = _scalar(str(node.tag), node.value, where, path)
        if key == "<<" and str(node.tag) == _PLAIN:
            raise SpecError(
                where, path, "merge keys (<<) are YAML 1.1 and not read; write the keys out"
            )
        if not isinstance(key, str):
            raise SpecError(where, path, f"expected string keys, got {preview(key)}")
        if len(key) > MAX_KEY_CHARS:
            raise SpecError(
                where,
                path,
                f"expected keys of at most {MAX_KEY_CHARS} characters, got {preview(key)}",
            )
        return key


def _unsupported(tag: str) -> str:
    return (
        f"unsupported YAML tag {preview(tag)}; a spec holds strings, numbers, true/false, null, "
        "lists and mappings"
    )


def _scalar(tag: str, text: str, where: str, path: str) -> Any:
    """A scalar's value by YAML 1.2's core schema (a tag among its types names the type)."""
    if tag == _PLAIN:
        for kind in ("null", "bool", "int", "float"):
            value = _as(kind, text)
            if value is not _NOT:
                return _checked_number(value, text, where, path)
        return text
    if tag == _CORE + "str":
        return text
    kind = tag.removeprefix(_CORE)
    if tag.startswith(_CORE) and kind in ("null", "bool", "int", "float"):
        value = _as(kind, text)
        if value is _NOT:
            raise SpecError(where, path, f"!!{kind} {preview(text)}: expected a YAML 1.2 {kind}")
        return _checked_number(value, text, where, path)
    raise SpecError(where, path, _unsupported(tag))


_NOT: Any = object()


def _as(kind: str, text: str) -> Any:
    """``text`` read as the core schema's ``kind``; _NOT when it is not one."""
    if kind == "null":
        return None if _NULL.fullmatch(text) else _NOT
    if kind == "bool":
        return _BOOL.get(text, _NOT)
    if kind == "int":
        if _INT.fullmatch(text):
            return _HugeInt(text) if len(text.lstrip("+-")) > MAX_INT_DIGITS else int(text, 10)
        if _INT_OCT.fullmatch(text) or _INT_HEX.fullmatch(text):
            digits = text[2:]
            if len(digits) > MAX_INT_DIGITS:
                return _HugeInt(text)
            return int(digits, 8 if text[1] == "o" else 16)
        return _NOT
    if _INF.fullmatch(text):
        return float("-inf" if text.startswith("-") else "inf")
    if _NAN.fullmatch(text):
        return float("nan")
    return float(text) if _FLOAT.fullmatch(text) else _NOT


class _HugeInt(str):
    """An integer literal too long to be a number a spec needs."""


def _checked_number(value: Any, text: str, where: str, path: str) -> Any:
    if isinstance(value, _HugeInt):
        raise SpecError(where, path, huge_int_message(text))
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(where, path, f"expected a finite number, got {cut(text, 20)}")
    return value


def huge_int_message(text: str) -> str:
    """The error for an integer literal of more than MAX_INT_DIGITS digits."""
    return (
        f"expected a number of at most {MAX_INT_DIGITS} digits, got one of {len(text)} "
        f"({text[:12]}...)"
    )


_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxlist, _PREVIEW.maxdict = 2, 3, 3
_PREVIEW.maxstring = _PREVIEW.maxother = 40


def preview(value: Any, limit: int = 40) -> str:
    """``value`` as an error message shows it: its repr, cut to about ``limit`` characters (a
    string says its length); never walks more than a few items of a list or mapping."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return _PREVIEW.repr(value)


def cut(text: str, limit: int = 60) -> str:
    """``text`` as an error message echoes it: its start and length when long."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


# A value that YAML 1.2 reads as a plain scalar on its own: no indicator, space or colon.
_SIMPLE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def parse_override(text: str) -> tuple[tuple[str | int, ...], Any]:
    """Split ``key.path=value`` into path parts and a value read as a YAML/JSON scalar or list
    (within the bounds of a YAML spec); UsageError when it is not of that form."""
    key, sep, value_text = text.partition("=")
    parts = key.strip().split(".")
    shown = f"--set {cut(text)}"
    if not sep or not all(re.fullmatch(r"[A-Za-z0-9_.-]+", p) for p in parts):
        raise UsageError(
            f"--set {preview(text, 60)}: expected KEY.PATH=VALUE, e.g. tasks.worker.count=4"
        )
    if len(value_text.encode()) > MAX_OVERRIDE_BYTES:
        raise UsageError(f"{shown}: expected a value of at most {MAX_OVERRIDE_BYTES >> 10} KiB")
    value: Any = ""
    if value_text.strip():
        try:
            if _SIMPLE.fullmatch(value_text):
                # A word or number (count=4, backend=slurm) reads the same without ruamel.
                return _loc(parts), _scalar(_PLAIN, value_text, shown, "$")
            node = _compose(value_text, shown)
            value = _Expander(shown, {}).plain(node, ()) if node is not None else None
        except SpecError as exc:
            hint = ""
            if exc.message.startswith("invalid YAML"):  # e.g. "*", an alias to YAML
                quoted = json.dumps(value_text) if len(value_text) <= 40 else '"..."'
                hint = f"; to mean the text, quote it: {key.strip()}='{quoted}'"
            raise UsageError(f"{shown}: the value: {exc.message}{hint}") from None
        except RecursionError:
            raise UsageError(f"{shown}: the value is nested too deeply") from None
    return _loc(parts), value


def _loc(parts: list[str]) -> tuple[str | int, ...]:
    """A `--set` key's parts, list indices as integers."""
    return tuple(int(p) if p.isdecimal() and p.isascii() else p for p in parts)


def apply_overrides(source: Source, overrides: Iterable[str], shown: str) -> None:
    """Write each ``key.path=value`` into the raw spec, creating objects on the way."""
    for full in overrides:
        loc, value = parse_override(full)
        text = cut(full)  # as error messages echo it
        node = source.raw
        for i, part in enumerate(loc[:-1]):
            nxt = loc[i + 1]
            if isinstance(node, dict) and isinstance(part, str):
                if node.get(part) is None:
                    node[part] = {}
                elif not isinstance(node[part], (dict, list)):
                    raise SpecError(
                        shown,
                        short_path(json_path(loc[: i + 1])),
                        f"--set {text}: cannot set a key in {preview(node[part])}; set "
                        f"{'.'.join(map(str, loc[: i + 1]))}=... instead",
                    )
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
