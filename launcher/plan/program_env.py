"""What a program sets in its environment before it imports TensorFlow, read from its source.

TensorFlow and Keras read some variables once, at import (``TF_ENABLE_ONEDNN_OPTS``,
``TF_CPP_MIN_LOG_LEVEL``, ``KERAS_BACKEND``...). A warm standby
(launcher/transports/local/standby.py) imports them before the program runs, so it must first make
the same writes the program makes before its own first import, or the restarted program would run
with a TensorFlow set up otherwise than at a cold start. This module finds those writes
(`before_tensorflow`): plain ones, which the standby repeats for its imports and then undoes, or a
reason why a standby cannot repeat them, in which case the program restarts cold.

A write can be repeated when it is a statement of the module's top level (or of its ``if __name__
== "__main__":`` block) that comes before the first TensorFlow import, with string literals only:
``os.environ["K"] = "V"``, ``os.environ.setdefault("K", "V")``, ``os.environ.update({"K": "V"})``
(or ``K="V"``), ``os.putenv("K", "V")``, ``del os.environ["K"]``, ``os.environ.pop("K")``. Any
other write before that import (computed, conditional, in a function, ``os.environ.clear()``...)
cannot. Nor can any write where the first import is inside a function: when that function runs,
relative to the writes, is not in the source. Writes after a top-level import come after it in
every run, warm or cold, and do not matter.

A module of the program's own (found in its folder) that it imports at the top level before
TensorFlow is read too, one level deep: any environment write in it makes the program restart
cold, since when it runs relative to the import is up to that module.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

# Imports that load TensorFlow or a Keras (what a standby imports in advance; distlaunch.worker
# imports TensorFlow).
TF_MODULES = ("tensorflow", "keras", "tf_keras", "distlaunch")
# The writes a standby repeats: os.environ[name] = value, os.environ.setdefault, os.putenv, and
# removing a name.
SET, SETDEFAULT, PUTENV, UNSET = "set", "setdefault", "putenv", "unset"
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass(frozen=True)
class EnvWrite:
    """One write a standby repeats before its imports: ``op`` (SET, SETDEFAULT, PUTENV or UNSET)
    of ``name`` (to ``value``), written at ``line``."""

    op: str
    name: str
    value: str
    line: int

    def to_json(self) -> list:
        """``[op, name, value]``, as the bootstrap reads it."""
        return [self.op, self.name, self.value]


@dataclass(frozen=True)
class StandbyEnv:
    """What a standby must do for its imports to match the program's."""

    writes: tuple[EnvWrite, ...] = ()  # to repeat, in program order
    cold: str = ""  # why a standby cannot stand in for the program ("": it can)


def before_tensorflow(
    tree: ast.Module,
    filename: str,
    own_module: Callable[[str], tuple[str, str] | None] = lambda name: None,
) -> StandbyEnv:
    """The environment writes ``tree`` (a program's parsed source) makes before its first
    TensorFlow import, or why they cannot be repeated. ``own_module`` gives the source and file
    of a module of the program's own, None for any other."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = _Names(tree)
    imports = sorted(
        (node.lineno, node.col_offset, _in_function(node, parents))
        for node in ast.walk(tree)
        if _imports_tensorflow(node)
    )
    if not imports:
        return StandbyEnv()
    first, column, in_function = imports[0]
    for node in tree.body:
        if (node.lineno, node.col_offset) >= (first, column):
            break
        for name in _imported(node):
            found = own_module(name)
            line = _any_write(*found) if found is not None else None
            if found is not None and line is not None:
                return StandbyEnv(
                    cold=f"{filename}:{node.lineno} imports {name}, which sets the environment "
                    f"({found[1]}:{line}) before TensorFlow is imported ({filename}:{first})"
                )
    found: list[EnvWrite] = []
    for (line, col), writes in sorted(_writes(tree, names, parents), key=lambda item: item[0]):
        where = f"{filename}:{line}"
        if (line, col) >= (first, column) and not in_function:
            break  # a top-level import has run by then
        if (line, col) >= (first, column):
            return StandbyEnv(
                cold=f"{where} sets the environment and TensorFlow is first imported in a "
                f"function ({filename}:{first}): which comes first is not in the source"
            )
        if writes is None:
            return StandbyEnv(
                cold=f"{where} sets the environment before TensorFlow is imported "
                f"({filename}:{first}) otherwise than with plain strings at the top level"
            )
        found.extend(writes)
    return StandbyEnv(tuple(found))


class _Names:
    """The names a module binds to ``os``, ``os.environ``, ``os.putenv`` and ``os.unsetenv``."""

    def __init__(self, tree: ast.Module) -> None:
        self.os = {"os"}
        self.environ: set[str] = set()
        self.putenv: set[str] = set()
        self.unsetenv: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.os |= {a.asname for a in node.names if a.name == "os" and a.asname}
            elif isinstance(node, ast.ImportFrom) and node.module == "os" and not node.level:
                for alias in node.names:
                    bound = alias.asname or alias.name
                    {"environ": self.environ, "putenv": self.putenv, "unsetenv": self.unsetenv}.get(
                        alias.name, set()
                    ).add(bound)

    def is_environ(self, node: ast.AST) -> bool:
        """Whether ``node`` is ``os.environ`` (under any name)."""
        if isinstance(node, ast.Name):
            return node.id in self.environ
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "environ"
            and isinstance(node.value, ast.Name)
            and node.value.id in self.os
        )

    def is_os_function(self, node: ast.AST, name: str) -> bool:
        """Whether ``node`` is ``os.putenv`` or ``os.unsetenv`` (``name``) under any name."""
        if isinstance(node, ast.Name):
            return node.id in (self.putenv if name == "putenv" else self.unsetenv)
        return (
            isinstance(node, ast.Attribute)
            and node.attr == name
            and isinstance(node.value, ast.Name)
            and node.value.id in self.os
        )


def _imported(node: ast.stmt) -> list[str]:
    """The modules a top-level import statement names (none of TensorFlow's)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if not _is_module(a.name)]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [] if _is_module(node.module) else [node.module]
    return []


def _any_write(source: str, filename: str) -> int | None:
    """The line of the first environment write in ``source``, None if it has none or does not
    parse (the program then fails there, cold or warm)."""
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return None
    names = _Names(tree)
    lines = [getattr(n, "lineno", 0) for n in ast.walk(tree) if _write(n, names) is not False]
    return min(lines, default=None)


def _imports_tensorflow(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(_is_module(a.name) for a in node.names)
    return isinstance(node, ast.ImportFrom) and not node.level and _is_module(node.module or "")


def _is_module(name: str) -> bool:
    return any(is_module(name, m) for m in TF_MODULES)


def is_module(name: str, module: str) -> bool:
    """Whether dotted name ``name`` is ``module`` or one of its submodules."""
    return name == module or name.startswith(module + ".")


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, _FUNCTIONS):
            return True
    return False


def _writes(
    tree: ast.Module, names: _Names, parents: dict[ast.AST, ast.AST]
) -> list[tuple[tuple[int, int], tuple[EnvWrite, ...] | None]]:
    """Every environment write in ``tree``: its line and what it writes, None where that cannot
    be repeated (not literal, or not a top-level statement)."""
    out = []
    for node in ast.walk(tree):
        writes = _write(node, names)
        if writes is False:
            continue
        statement = node if isinstance(node, ast.stmt) else parents.get(node)
        top = (
            isinstance(statement, ast.stmt)
            and (statement is node or isinstance(statement, ast.Expr))
            and _top_level(statement, parents)
        )
        out.append(((node.lineno, node.col_offset), writes if top else None))
    return out


def _top_level(statement: ast.stmt, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``statement`` runs whenever the module runs as __main__ (up to an exception)."""
    node: ast.AST = statement
    while True:
        parent = parents.get(node)
        if parent is None or isinstance(parent, ast.Module):
            return True
        if isinstance(parent, ast.If) and _is_main_check(parent.test) and node in parent.body:
            node = parent
            continue
        if isinstance(parent, (ast.Try, ast.With)) and node in parent.body:
            node = parent
            continue
        return False


def _is_main_check(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and _text(test.comparators[0]) == "__main__"
    )


def _write(node: ast.AST, names: _Names) -> tuple[EnvWrite, ...] | None | bool:
    """What ``node`` writes to the environment: the writes, None for a write that cannot be
    repeated, False for no write at all."""
    line = getattr(node, "lineno", 0)
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        hit = [t for t in targets if names.is_environ(t) or _environ_item(t, names)]
        if not hit:
            return False
        if isinstance(node, ast.Delete):
            keys = [_text(t.slice) if isinstance(t, ast.Subscript) else None for t in hit]
            if len(hit) != len(targets) or None in keys:
                return None
            return tuple(EnvWrite(UNSET, k, "", line) for k in keys if k is not None)
        if not isinstance(node, ast.Assign) or len(targets) != 1 or names.is_environ(hit[0]):
            return None
        key, value = _text(hit[0].slice), _text(node.value)  # type: ignore[attr-defined]
        return None if key is None or value is None else (EnvWrite(SET, key, value, line),)
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if names.is_os_function(func, "putenv"):
        return _pair(PUTENV, node, line)
    if names.is_os_function(func, "unsetenv"):
        return None
    if not (isinstance(func, ast.Attribute) and names.is_environ(func.value)):
        return False
    if func.attr in ("get", "copy", "items", "keys", "values", "__contains__", "__getitem__"):
        return False
    if func.attr in ("setdefault", "__setitem__"):
        return _pair(SETDEFAULT if func.attr == "setdefault" else SET, node, line)
    if func.attr == "pop" and len(node.args) in (1, 2) and not node.keywords:
        key = _text(node.args[0])
        return None if key is None else (EnvWrite(UNSET, key, "", line),)
    if func.attr == "update":
        return _update(node, line)
    return None  # clear, popitem, __delitem__, ...: a write, and not one to repeat


def _environ_item(node: ast.AST, names: _Names) -> bool:
    return isinstance(node, ast.Subscript) and names.is_environ(node.value)


def _pair(op: str, call: ast.Call, line: int) -> tuple[EnvWrite, ...] | None:
    if len(call.args) != 2 or call.keywords:
        return None
    key, value = _text(call.args[0]), _text(call.args[1])
    return None if key is None or value is None else (EnvWrite(op, key, value, line),)


def _update(call: ast.Call, line: int) -> tuple[EnvWrite, ...] | None:
    pairs: list[tuple[str | None, str | None]] = []
    if len(call.args) > 1:
        return None
    if call.args:
        given = call.args[0]
        if not isinstance(given, ast.Dict) or None in given.keys:
            return None
        pairs += [(_text(k), _text(v)) for k, v in zip(given.keys, given.values)]
    pairs += [(k.arg, _text(k.value)) for k in call.keywords]
    if any(k is None or v is None for k, v in pairs):
        return None
    return tuple(EnvWrite(SET, k, v, line) for k, v in pairs)  # type: ignore[arg-type]


def _text(node: ast.AST | None) -> str | None:
    """The string a literal ``node`` is, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None
