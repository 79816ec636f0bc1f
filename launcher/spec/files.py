"""Reading a spec file: YAML 1.2 by its suffix (spec/sources.py), else JSON read strictly.

JSON's reader keeps the last of two equal keys and turns any digit string into an int: here a key
written twice is an error naming its path, and an integer literal too long to be a spec's number
stays digits (`check_numbers` refuses it with its path, as it refuses NaN and infinities), so a
hostile file costs no more than its size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec.invalid import json_path, short_path, shown
from distlaunch.launcher.spec.sources import (
    MAX_INT_DIGITS,
    Source,
    huge_int_message,
    preview,
    read_yaml,
)

YAML_SUFFIXES = (".yaml", ".yml")


def read(file: Path, shown: str) -> Source:
    """The raw spec in ``file`` (YAML by its suffix, else JSON), checked for duplicate keys."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(shown, "$", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(shown, "$", f"cannot read: {exc}") from None
    if file.suffix.lower() in YAML_SUFFIXES:
        try:
            source = read_yaml(text, shown)
        except RecursionError:
            raise SpecError(shown, "$", "invalid YAML: nested too deeply") from None
        if not isinstance(source.raw, dict):
            raise SpecError(shown, "$", "expected a YAML mapping")
        return source
    try:
        raw = json.loads(
            text,
            object_pairs_hook=_DupCheckingDict.from_pairs,
            parse_int=_parse_int,
            parse_constant=_refuse_constant,
        )
    except json.JSONDecodeError as exc:
        raise SpecError(
            shown, "$", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise SpecError(shown, "$", "invalid JSON: nested too deeply") from None
    try:
        dup = _find_duplicate_key(raw, ())
    except RecursionError:
        raise SpecError(shown, "$", "nested too deeply; expected a cluster spec") from None
    if dup is not None:
        loc, key = dup
        where = short_path(json_path(loc + (key,)))
        raise SpecError(shown, where, f"key {preview(key)} appears twice; expected it once")
    if not isinstance(raw, dict):
        raise SpecError(shown, "$", "expected a JSON object")
    return Source(raw=raw, file=shown)


class BadNumber(Exception):
    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        self.loc = loc
        self.message = message


def check_numbers(node: Any, loc: tuple[str | int, ...]) -> None:
    """A float that is infinite or NaN, or an integer literal of over MAX_INT_DIGITS digits
    (JSON's, read as a `_Digits`), is no number a spec holds: say where it is."""
    if isinstance(node, dict):
        for key, child in node.items():
            check_numbers(child, (*loc, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            check_numbers(child, (*loc, i))
    elif isinstance(node, _Digits):
        raise BadNumber(loc, huge_int_message(node.text))
    elif isinstance(node, float) and not math.isfinite(node):
        raise BadNumber(loc, f"expected a finite number, got {shown(node)}")


class _Digits:
    """A JSON integer literal too long to be a number a spec needs (Python refuses to convert
    one over 4300 digits): no string, so that no string field takes it."""

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_int(text: str) -> int | _Digits:
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _Digits(text)


def _refuse_constant(text: str) -> float:
    return float(text)  # NaN and Infinity: found by check_numbers with their path


class _DupCheckingDict(dict):
    """A JSON object that remembers a key it saw twice (json.loads keeps the last silently)."""

    duplicate: str | None = None

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, Any]]) -> _DupCheckingDict:
        obj = cls()
        for key, value in pairs:
            if key in obj and obj.duplicate is None:
                obj.duplicate = key
            obj[key] = value
        return obj


def _find_duplicate_key(
    node: Any, loc: tuple[str | int, ...]
) -> tuple[tuple[str | int, ...], str] | None:
    if isinstance(node, _DupCheckingDict):
        if node.duplicate is not None:
            return loc, node.duplicate
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for key, child in items:
        found = _find_duplicate_key(child, loc + (key,))
        if found:
            return found
    return None
