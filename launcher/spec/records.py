"""Typed, frozen records read from JSON data: the machinery under spec/model.py's models.

A record class declares its fields as annotated class attributes (a `Field` for a default,
constraints and a description); `model_validate` turns plain data into an instance or raises `Invalid`
for the first problem, with its location. Types are strict (no coercion: "2" is no number, no
float is infinite or NaN), unknown keys are refused, and `before`/`after` checks run around the
fields. `json_schema` publishes the same rules.

Why not pydantic, which did this before: the launcher validates its spec at every start, and
importing pydantic and building the spec's models was 0.08 s of a 0.17 s start (`distlaunch
--help` paid it too). This module keeps what spec/model.py used of it, in the same words: error
messages, JSON paths and the JSON Schema did not change.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import types
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args, get_origin

_MISSING: Any = object()


class Invalid(Exception):
    """The first problem in the data: its location (keys and list indices), its kind, the
    message, the value found, and for a failed check the check's own error."""

    def __init__(
        self,
        loc: tuple[str | int, ...],
        kind: str,
        msg: str,
        value: Any,
        error: ValueError | None = None,
    ) -> None:
        super().__init__(f"{'.'.join(map(str, loc)) or '(root)'}: {msg}")
        self.loc = loc
        self.kind = kind
        self.msg = msg
        self.value = value
        self.error = error


class Field:
    """A field's default and constraints; also an `Annotated` marker for a list's items."""

    def __init__(
        self,
        default: Any = _MISSING,
        *,
        default_factory: Callable[[], Any] | None = None,
        description: str | None = None,
        pattern: str | None = None,
        min_length: int | None = None,
        max_length: int | None = None,
        ge: float | None = None,
        gt: float | None = None,
        le: float | None = None,
    ) -> None:
        self.default = default
        self.default_factory = default_factory
        self.description = description
        self.pattern = pattern
        self._regex: re.Pattern[str] | None = None  # compiled on first use: most are never used
        self.min_length = min_length
        self.max_length = max_length
        self.ge = ge
        self.gt = gt
        self.le = le

    @property
    def required(self) -> bool:
        """Whether the field has no default."""
        return self.default is _MISSING and self.default_factory is None

    def check(self, value: Any, loc: tuple[str | int, ...], raw: Any = _MISSING) -> None:
        """Raise Invalid when the (well-typed) ``value`` breaks a constraint; the error shows
        ``raw``, the value as written (an integer where a float was expected), when given."""
        shown = value if raw is _MISSING else raw
        if isinstance(value, str | list):
            noun = "String" if isinstance(value, str) else "List"
            unit = "character" if isinstance(value, str) else "item"
            after = "" if isinstance(value, str) else " after validation"
            if self.min_length is not None and len(value) < self.min_length:
                plural = "" if self.min_length == 1 else "s"
                tail = "" if isinstance(value, str) else f", not {len(value)}"
                msg = f"{noun} should have at least {self.min_length} {unit}{plural}{after}{tail}"
                raise Invalid(loc, f"{noun.lower()}_too_short", msg, shown)
            if self.max_length is not None and len(value) > self.max_length:
                plural = "" if self.max_length == 1 else "s"
                tail = "" if isinstance(value, str) else f", not {len(value)}"
                msg = f"{noun} should have at most {self.max_length} {unit}{plural}{after}{tail}"
                raise Invalid(loc, f"{noun.lower()}_too_long", msg, shown)
            if self.pattern is not None and not self._matches(value):
                msg = f"String should match pattern '{self.pattern}'"
                raise Invalid(loc, "string_pattern_mismatch", msg, shown)
            return
        if self.le is not None and value > self.le:
            msg = f"Input should be less than or equal to {self.le}"
            raise Invalid(loc, "less_than_equal", msg, shown)
        if self.ge is not None and value < self.ge:
            msg = f"Input should be greater than or equal to {self.ge}"
            raise Invalid(loc, "greater_than_equal", msg, shown)
        if self.gt is not None and value <= self.gt:
            raise Invalid(loc, "greater_than", f"Input should be greater than {self.gt}", shown)

    def _matches(self, text: str) -> bool:
        if self._regex is None:
            # A final "$" ends the text, as in the JSON Schema (Python's allows a newline before it).
            end = self.pattern[:-1] + r"\Z" if self.pattern.endswith("$") else self.pattern
            self._regex = re.compile(end)
        return self._regex.search(text) is not None

    def schema(self, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` (a type's JSON Schema) with this field's constraints."""
        out = dict(base)
        is_list = base.get("type") == "array"
        if self.min_length is not None:
            out["minItems" if is_list else "minLength"] = self.min_length
        if self.max_length is not None:
            out["maxItems" if is_list else "maxLength"] = self.max_length
        if self.pattern is not None:
            out["pattern"] = self.pattern
        for key, bound in (
            ("maximum", self.le),
            ("minimum", self.ge),
            ("exclusiveMinimum", self.gt),
        ):
            if bound is not None:
                out[key] = bound
        return out


class Parsed:
    """An `Annotated` marker: ``parse`` checks the raw value whole (raising ValueError with the
    message) and returns the field's value; ``schema`` is its JSON Schema, or a function that
    makes it when a schema is asked for (one that costs something to know, like the backends)."""

    def __init__(
        self, parse: Callable[[Any], Any], schema: dict[str, Any] | Callable[[], dict[str, Any]]
    ) -> None:
        self.parse = parse
        self.schema = schema


def before(function: Callable[[type, Any], Any]) -> classmethod:
    """Mark a record's classmethod that reshapes the raw data before its fields are read."""
    function.__record_check__ = "before"  # type: ignore[attr-defined]
    return classmethod(function)


def after(function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Mark a record's method that checks the whole record once its fields are valid; it raises
    ValueError (or one carrying a location of its own) and returns the record."""
    function.__record_check__ = "after"  # type: ignore[attr-defined]
    return function


class Record:
    """A frozen record of typed fields, validated from plain data (JSON objects and lists)."""

    # Per class, filled on first use: name -> (type, Field), and the checks in declaration order.
    _schema_cache: dict[type, tuple[dict[str, tuple[Any, Field]], list, list]] = {}

    def __init__(self, **data: Any) -> None:
        made = type(self).model_validate(data)
        object.__setattr__(self, "__dict__", made.__dict__)

    @classmethod
    def fields(cls) -> dict[str, tuple[Any, Field]]:
        """The record's fields in declaration order: name -> (type, Field)."""
        return cls._parts()[0]

    @classmethod
    def _parts(cls) -> tuple[dict[str, tuple[Any, Field]], list, list]:
        parts = Record._schema_cache.get(cls)
        if parts is None:
            scope = vars(sys.modules[cls.__module__])
            fields = {}
            for name, annotation in cls.__dict__.get("__annotations__", {}).items():
                declared = cls.__dict__.get(name, _MISSING)
                field = declared if isinstance(declared, Field) else Field(declared)
                fields[name] = (eval(annotation, scope), field)  # our own source
            checks = [v for v in cls.__dict__.values() if _kind(v)]
            befores = [getattr(cls, v.__func__.__name__) for v in checks if _kind(v) == "before"]
            afters = [v for v in checks if _kind(v) == "after"]
            parts = Record._schema_cache[cls] = (fields, befores, afters)
        return parts

    @classmethod
    def model_validate(cls, data: Any, loc: tuple[str | int, ...] = ()) -> Any:
        """An instance made from ``data``; raise Invalid (located under ``loc``) for its first problem."""
        fields, befores, afters = cls._parts()
        for check in befores:
            data = _checked(check, data, loc)
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            msg = f"Input should be a valid dictionary or instance of {cls.__name__}"
            raise Invalid(loc, "model_type", msg, data)
        values = {}
        for name, (kind, field) in fields.items():
            if name in data:
                value = _value(kind, data[name], loc + (name,))
                if value is not None:
                    field.check(value, loc + (name,), data[name])
            elif field.default_factory is not None:
                value = field.default_factory()
            elif field.default is not _MISSING:
                value = field.default
            else:
                raise Invalid(loc + (name,), "missing", "Field required", data)
            values[name] = value
        for key in data:
            if not isinstance(key, str):
                raise Invalid(loc + (key,), "invalid_key", "Keys should be strings", key)
            if key not in fields:
                msg = "Extra inputs are not permitted"
                raise Invalid(loc + (key,), "extra_forbidden", msg, data[key])
        made = cls._make(values, frozenset(k for k in data if k in fields))
        for check in afters:
            made = _checked(lambda record, check=check: check(record), made, loc)
        return made

    @classmethod
    def _make(cls, values: dict[str, Any], given: frozenset[str]) -> Any:
        made = cls.__new__(cls)
        object.__setattr__(made, "__dict__", {**values, "_given": given})
        return made

    # The names below are pydantic's, which spec/model.py used before: its callers did not change.

    @property
    def model_fields_set(self) -> frozenset[str]:
        """The fields the data named (the others have their defaults)."""
        return self.__dict__["_given"]

    def model_copy(self, update: dict[str, Any] | None = None) -> Any:
        """A copy with the values of ``update`` (already valid: they are not checked again)."""
        changes = update or {}
        values = {name: getattr(self, name) for name in self.fields()}
        return self._make({**values, **changes}, self.model_fields_set | frozenset(changes))

    def model_dump(
        self, mode: Literal["python", "json"] = "python", exclude_unset: bool = False
    ) -> dict[str, Any]:
        """The record as plain data (in "json" mode tuples become lists); with ``exclude_unset``
        only the fields the data named, in this record and the records it holds."""
        names = [n for n in self.fields() if not exclude_unset or n in self.model_fields_set]
        return {name: _data(getattr(self, name), mode == "json", exclude_unset) for name in names}

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    def __hash__(self) -> int:
        return hash((type(self), *(repr(getattr(self, name)) for name in self.fields())))

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.fields())
        return f"{type(self).__name__}({shown})"


def _kind(value: Any) -> str | None:
    return getattr(getattr(value, "__func__", value), "__record_check__", None)


def _checked(check: Callable[[Any], Any], value: Any, loc: tuple[str | int, ...]) -> Any:
    try:
        return check(value)
    except ValueError as exc:
        raise Invalid(loc, "value_error", f"Value error, {exc}", value, exc) from None


def _data(value: Any, json: bool, exclude_unset: bool) -> Any:
    if isinstance(value, Record):
        return value.model_dump("json" if json else "python", exclude_unset)
    if isinstance(value, list | tuple):
        items = [_data(v, json, exclude_unset) for v in value]
        return items if json or isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _data(v, json, exclude_unset) for k, v in value.items()}
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _value(kind: Any, value: Any, loc: tuple[str | int, ...]) -> Any:
    """``value`` checked against the type ``kind`` (strictly)."""
    origin = get_origin(kind)
    if origin is Annotated:
        base, *marks = get_args(kind)
        for mark in marks:
            if isinstance(mark, Parsed):
                return _checked(mark.parse, value, loc)
        value = _value(base, value, loc)
        for mark in marks:
            mark.check(value, loc)
        return value
    if origin in (Union, types.UnionType):
        # Only "X | None" is declared; wider unions are Parsed.
        if value is None:
            return None
        (inner,) = [arg for arg in get_args(kind) if arg is not type(None)]
        return _value(inner, value, loc)
    if origin is Literal:
        options = get_args(kind)
        if any(type(value) is type(o) and value == o for o in options):
            return value
        shown = [repr(o) for o in options]
        expected = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
        raise Invalid(loc, "literal_error", f"Input should be {expected}", value)
    if origin is list:
        if not isinstance(value, list):
            raise Invalid(loc, "list_type", "Input should be a valid list", value)
        (item,) = get_args(kind)
        return [_value(item, v, loc + (i,)) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise Invalid(loc, "dict_type", "Input should be a valid dictionary", value)
        key_kind, item = get_args(kind)
        return {
            _value(key_kind, k, loc + (k, "[key]")): _value(item, v, loc + (k,))
            for k, v in value.items()
        }
    if isinstance(kind, type) and issubclass(kind, Record):
        return kind.model_validate(value, loc)
    if kind is str:
        if isinstance(value, str):
            return value
        raise Invalid(loc, "string_type", "Input should be a valid string", value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise Invalid(loc, "bool_type", "Input should be a valid boolean", value)
    if kind is int:
        if _is_int(value):
            return value
        raise Invalid(loc, "int_type", "Input should be a valid integer", value)
    if kind is float:
        if _is_int(value) or isinstance(value, float):
            if not math.isfinite(value):
                raise Invalid(loc, "finite_number", "Input should be a finite number", value)
            return float(value)
        raise Invalid(loc, "float_type", "Input should be a valid number", value)
    raise TypeError(f"records cannot hold {kind!r}")


def json_schema(root: type[Record]) -> dict[str, Any]:
    """The JSON Schema of ``root``, the records it holds under "$defs"."""
    defs: dict[str, Any] = {}
    out = _record_schema(root, defs)
    defs.pop(root.__name__, None)
    return {"$defs": dict(sorted(defs.items())), **out} if defs else out


def _record_schema(record: type[Record], defs: dict[str, Any]) -> dict[str, Any]:
    properties, required = {}, []
    for name, (kind, field) in record.fields().items():
        prop = _type_schema(kind, field, defs)
        if not _holds_record(kind):
            prop["title"] = name.title().replace("_", " ")
        if field.required:
            required.append(name)
        elif field.default_factory is None:
            prop["default"] = field.default
        if field.description is not None:
            prop["description"] = field.description
        properties[name] = dict(sorted(prop.items()))
    out: dict[str, Any] = {"additionalProperties": False}
    if record.__doc__:
        out["description"] = inspect.cleandoc(record.__doc__)
    out["properties"] = properties
    if required:
        out["required"] = required
    return {**out, "title": record.__name__, "type": "object"}


def _holds_record(kind: Any) -> bool:
    if get_origin(kind) in (Union, types.UnionType):
        return any(_holds_record(arg) for arg in get_args(kind))
    return isinstance(kind, type) and issubclass(kind, Record)


def _type_schema(kind: Any, field: Field | None, defs: dict[str, Any]) -> dict[str, Any]:
    origin = get_origin(kind)
    if origin is Annotated:
        base, *marks = get_args(kind)
        parsed = [
            mark.schema() if callable(mark.schema) else mark.schema
            for mark in marks
            if isinstance(mark, Parsed)
        ]
        if parsed:
            return _sorted(parsed[0])
        out = _type_schema(base, field, defs)
        for mark in marks:
            out = mark.schema(out)
        return dict(sorted(out.items()))
    if origin in (Union, types.UnionType):
        (inner,) = [arg for arg in get_args(kind) if arg is not type(None)]
        return {"anyOf": [_type_schema(inner, field, defs), {"type": "null"}]}
    if isinstance(kind, type) and issubclass(kind, Record):
        if kind.__name__ not in defs:
            defs[kind.__name__] = None  # a record that holds itself stops here
            defs[kind.__name__] = _record_schema(kind, defs)
        return {"$ref": f"#/$defs/{kind.__name__}"}
    if origin is Literal:
        options = list(get_args(kind))
        out = {"const": options[0]} if len(options) == 1 else {"enum": options}
        return {**out, "type": "string"}
    if origin is list:
        out = {"items": _type_schema(get_args(kind)[0], None, defs), "type": "array"}
    elif origin is dict:
        out = {
            "additionalProperties": _type_schema(get_args(kind)[1], None, defs),
            "type": "object",
        }
    else:
        out = {"type": {str: "string", bool: "boolean", int: "integer", float: "number"}[kind]}
    out = field.schema(out) if field is not None else out
    return dict(sorted(out.items()))


def _sorted(schema: Any) -> Any:
    """``schema`` with every object's keys in order, as the generated parts have them."""
    if isinstance(schema, dict):
        return {key: _sorted(schema[key]) for key in sorted(schema)}
    if isinstance(schema, list):
        return [_sorted(item) for item in schema]
    return schema
