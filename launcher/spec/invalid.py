"""A spec's first schema violation as one line: the JSON path as the user wrote it and what was
expected, from the failed rule and the schema's own words (spec/schema.py's ``x-`` keys).

spec/checker.py (the schema compiled by fastjsonschema) raises `Invalid`; `spec_error` turns it
into the SpecError the CLI prints. No library text reaches the user.
"""

from __future__ import annotations

import json
import re
from typing import Any

from distlaunch.launcher.core.errors import SpecError


class Invalid(ValueError):
    """The first value spec/checker.py refuses: ``name`` is its place ("data.tasks.worker"),
    ``rule`` the schema keyword it breaks and ``definition`` the schema that holds the rule.
    (The signature is fastjsonschema's exception's, which the generated code calls.)"""

    def __init__(
        self,
        message: str,
        value: Any = None,
        name: str | None = None,
        definition: Any = None,
        rule: str | None = None,
    ) -> None:
        super().__init__(message)
        self.value = value
        self.name = name or "data"
        self.definition = definition if isinstance(definition, dict) else {}
        self.rule = rule


# The generated code's name for the exception (fastjsonschema's), so that it needs no import of it.
JsonSchemaValueException = Invalid


def spec_error(shown: str, raw: Any, error: Invalid) -> SpecError:
    """``error`` (found in ``raw``) as the one line that names the file ``shown``."""
    loc = locate(raw, error.name[len("data") :])
    value = error.value
    definition = error.definition
    rule = error.rule or ""
    if rule == "additionalProperties" and isinstance(value, dict):
        key = _extra_key(value, definition)
        loc = (*loc, key)
        if "x-key" in definition:
            message = f"expected {definition['x-key']}, got {_key(key)}"
        else:
            allowed = ", ".join(definition.get("properties", ()))
            message = f"unknown key {_key(key)}; expected one of: {allowed}"
        return SpecError(shown, short_path(json_path(loc)), message)
    if rule == "required" and isinstance(value, dict):
        missing = next(k for k in definition["required"] if k not in value)
        loc = (*loc, missing)
        message = definition.get("x-error", "required key is missing")
        return SpecError(shown, short_path(json_path(loc)), message)
    secret = tuple(loc[:2]) == ("program", "env")
    return SpecError(shown, short_path(json_path(loc)), _message(rule, definition, value, secret))


def _message(rule: str, definition: dict[str, Any], value: Any, secret: bool) -> str:
    if "x-error" in definition:
        return definition["x-error"]
    expected = _expected(rule, definition, value)
    if "x-expected" in definition and (rule != "type" or "type" not in definition):
        expected = definition["x-expected"]  # a wrong type says which type, in plain words
    if secret:  # environment values are often secrets: say what was expected, never the value
        return f"expected {expected} (the value is not shown: it may be a secret)"
    return f"expected {expected}, got {shown(value)}"


_TYPES = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "object": "an object",
    "array": "a list",
    "null": "null",
}


def _expected(rule: str, definition: dict[str, Any], value: Any) -> str:
    """What the rule wants, in words."""
    kinds = definition.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    what = " or ".join(_TYPES[k] for k in kinds) or "a value"
    if rule in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        noun = "an integer" if "integer" in kinds else "a number"
        low = definition.get("minimum")
        high = definition.get("maximum")
        above = definition.get("exclusiveMinimum")
        if low is not None and high is not None:
            return f"{noun} from {low} to {high}"
        if above is not None and high is not None:
            return f"{noun} greater than {above} and at most {high}"
        if low is not None:
            return f"{noun} >= {low}"
        return f"{noun} <= {high}" if high is not None else f"{noun} > {above}"
    if rule == "enum":
        options = [shown(o) for o in definition["enum"]]
        return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"
    if rule == "const":
        return shown(definition["const"])
    if rule == "minLength":
        n = definition["minLength"]
        return "a non-empty string" if n == 1 else f"a string of at least {n} characters"
    if rule == "maxLength":
        return f"a string of at most {definition['maxLength']} characters"
    if rule == "minItems":
        return f"a list of at least {definition['minItems']} items"
    if rule == "maxItems":
        return f"a list of at most {definition['maxItems']} items"
    if rule == "uniqueItems":
        return "a list of distinct items"
    if rule == "pattern":
        return f"text matching {definition['pattern']}"
    return what


def _extra_key(value: dict[str, Any], definition: dict[str, Any]) -> str:
    """The first key of ``value`` that neither ``properties`` nor ``patternProperties`` takes."""
    named = definition.get("properties", {})
    # As the checker reads patternProperties (Python's "$": spec/schema.py's patterns allow for it).
    patterns = [re.compile(p) for p in definition.get("patternProperties", {})]
    return next(k for k in value if k not in named and not any(p.search(k) for p in patterns))


def locate(raw: Any, rest: str) -> tuple[str | int, ...]:
    """The keys and indices of the place that fastjsonschema names ``data`` + ``rest``
    (".hosts.node1.example.com.port"): a key may hold dots, so the data says where keys end."""
    if not rest:
        return ()
    if isinstance(raw, list) and rest.startswith("["):
        end = rest.index("]")
        index = int(rest[1:end])
        inner = raw[index] if index < len(raw) else None
        return (index, *locate(inner, rest[end + 1 :]))
    if isinstance(raw, dict) and rest.startswith("."):
        # The longest key that fits first: "a.b" before "a" when both are keys.
        for key in sorted((k for k in raw if isinstance(k, str)), key=len, reverse=True):
            after = rest[1 + len(key) :]
            if rest[1:].startswith(key) and (not after or after[0] in ".["):
                try:
                    return (key, *locate(raw[key], after))
                except (ValueError, IndexError):
                    continue
    raise ValueError(f"no place {rest!r} in the data")


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def json_path(loc: Any) -> str:
    """``("tasks", "worker", 0)`` as ``$.tasks.worker[0]``; a key that is not a plain name is
    quoted: ``$.hosts["bad name"]``."""
    out = "$"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            out += f".{part}"
        else:
            out += f"[{json.dumps(part)}]"
    return out


def short_path(path: str) -> str:
    """A JSON path as an error message shows it: its start and end when long."""
    return path if len(path) <= 120 else f"{path[:60]}...{path[-56:]}"


def shown(value: Any) -> str:
    """``value`` as JSON for an error message, cut short: a message is one readable line."""
    text = json.dumps(value, default=str, ensure_ascii=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _key(key: str) -> str:
    return repr(key) if len(key) <= 40 else f"{key[:40]!r}... ({len(key)} characters)"


class JsonSchemaValuesException(Invalid):
    """fastjsonschema's exception for several errors at once: never raised (the checker stops
    at the first), named by the generated code's handlers."""
