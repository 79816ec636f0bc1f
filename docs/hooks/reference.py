"""The documentation's generated parts (a MkDocs hook, see mkdocs.yml): what the docs must never
restate by hand, because the code is its one source.

- the spec reference: every key of `distlaunch schema`'s JSON Schema, with its type, default,
  bounds and description (``<!-- generated: spec-reference -->`` in a page);
- the known-failure catalog: every hint the launcher can print, with what it is recognised by
  (``<!-- generated: hints -->``);
- a package tree for mkdocstrings: the installed layout (`distlaunch` is launcher/root,
  `distlaunch.launcher` is launcher/ ...: pyproject's package-dir) as plain folders of links, so
  that the API reference reads the docstrings from the source.

The generators walk JSON Schema generically (properties, $defs/$ref, anyOf/oneOf/allOf, enum,
const, type, items, additionalProperties, default, description, bounds): whatever shape the
schema takes, every key it has gets a row.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections import deque
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PACKAGES = REPO / "build" / "docs-packages"  # mkdocs.yml's mkdocstrings `paths`
SPEC_MARK = "<!-- generated: spec-reference -->"
HINTS_MARK = "<!-- generated: hints -->"


def schema() -> dict[str, Any]:
    """The spec's JSON Schema, as `distlaunch schema` prints it."""
    out = subprocess.run(
        [sys.executable, "-m", "distlaunch.launcher", "schema"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


# ---- the spec reference --------------------------------------------------------------------


class _Sections:
    """The objects of a schema, each to become one section, in the order they are first met."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.defs: dict[str, Any] = {**root.get("definitions", {}), **root.get("$defs", {})}
        self.queue: deque[tuple[str, str, dict[str, Any]]] = deque()  # anchor, title, object
        self.where: dict[str, list[str]] = {}  # anchor -> the key paths that use it

    def add(self, anchor: str, title: str, node: dict[str, Any], path: str) -> str:
        """Queue ``node`` (an object with properties) once; return its anchor."""
        if anchor not in self.where:
            self.where[anchor] = []
            self.queue.append((anchor, title, node))
        if path and path not in self.where[anchor]:
            self.where[anchor].append(path)
        return anchor

    def resolve(self, ref: str) -> tuple[str, dict[str, Any]]:
        """The name and schema a local ``$ref`` points at."""
        name = ref.rsplit("/", 1)[-1]
        node: Any = self.root
        for part in ref.removeprefix("#/").split("/"):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return name, node if isinstance(node, dict) else {}


def anchor_of(name: str) -> str:
    """The section anchor of a schema object named ``name``."""
    return "spec-" + "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def type_text(node: Any, sections: _Sections, path: str) -> str:
    """What ``node`` accepts, in words, linking the objects it holds to their sections."""
    if node is True or node == {}:
        return "any"
    if not isinstance(node, dict):
        return "any"
    if "$ref" in node:
        name, target = sections.resolve(node["$ref"])
        if _is_object(target):
            anchor = sections.add(anchor_of(name), target.get("title") or name, target, path)
            return f"[{name}](#{anchor})"
        return type_text(target, sections, path)
    for key, joiner in (("anyOf", " or "), ("oneOf", " or "), ("allOf", " and ")):
        if key in node:
            parts = [type_text(option, sections, path) for option in node[key]]
            return joiner.join(dict.fromkeys(parts))  # once each, in order
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    if "enum" in node:
        return " | ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    kind = node.get("type")
    if isinstance(kind, list):
        return " or ".join(type_text({**node, "type": k}, sections, path) for k in kind)
    if kind == "array":
        items = node.get("items")
        text = f"list of {type_text(items, sections, path + '[]')}" if items else "list"
        return text + _bounds(node)
    if kind == "object" or "properties" in node:
        if node.get("properties"):
            title = node.get("title") or path or "object"
            return f"[{title}](#{sections.add(anchor_of(path or title), title, node, path)})"
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            return f"map of names to {type_text(extra, sections, path + '.<name>')}"
        return "object"
    if kind is None:
        return "any"
    return f"{kind}{_bounds(node)}"


def _is_object(node: dict[str, Any]) -> bool:
    return bool(node.get("properties")) and node.get("type", "object") == "object"


_BOUNDS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "min length {}"),
    ("maxLength", "max length {}"),
    ("minItems", "min items {}"),
    ("maxItems", "max items {}"),
)


def _bounds(node: dict[str, Any]) -> str:
    words = [form.format(node[key]) for key, form in _BOUNDS if key in node]
    if node.get("uniqueItems"):
        words.append("no repeats")
    return f" ({', '.join(words)})" if words else ""


def _cell(text: str) -> str:
    """``text`` fit for one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def spec_reference(root: dict[str, Any]) -> str:
    """The spec reference page's body: one section per object of the schema, one table row
    per key."""
    sections = _Sections(root)
    sections.add("spec-top-level", "The spec (top level)", root, "")
    walked = []  # anchor, title, object, rows: every use of an object is known only at the end
    while sections.queue:
        anchor, title, node = sections.queue.popleft()
        required = set(node.get("required", ()))
        prefix = _path_prefix(sections, anchor)
        rows = []
        for key, prop in node.get("properties", {}).items():
            kind = type_text(prop, sections, f"{prefix}{key}")
            if key in required:
                default = "required"
            elif isinstance(prop, dict) and "default" in prop:
                default = f"`{json.dumps(prop['default'])}`"
            else:
                default = ""
            description = prop.get("description", "") if isinstance(prop, dict) else ""
            rows.append(f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(description)} |")
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            kind = type_text(extra, sections, f"{prefix}<name>")
            rows.append(f"| `<name>` | {_cell(kind)} | | any other key: a name of your choice |")
        walked.append((anchor, title, node, rows))
    out = []
    for anchor, title, node, rows in walked:
        out.append(f"## {title} {{#{anchor}}}\n")
        used = sections.where.get(anchor) or []
        if used:
            out.append("Used at " + ", ".join(f"`{p}`" for p in used) + ".\n")
        if node.get("description"):
            out.append(_cell(node["description"]) + "\n")
        if node.get("additionalProperties") is False:
            out.append("No other key is allowed.\n")
        out.append("| key | type | default | description |\n|---|---|---|---|")
        out.append("\n".join(rows) + "\n")
    return "\n".join(out)


def _path_prefix(sections: _Sections, anchor: str) -> str:
    """The key path (with a dot) under which an object's keys sit: its first use."""
    used = sections.where.get(anchor) or []
    return f"{used[0]}." if used else ""


def object_keys(root: dict[str, Any]) -> dict[str, set[str]]:
    """Every object of the schema that has keys (by its section anchor) and its keys: what the
    reference must list."""
    sections = _Sections(root)
    sections.add("spec-top-level", "", root, "")
    found = {}
    while sections.queue:
        anchor, _, node = sections.queue.popleft()
        found[anchor] = set(node.get("properties", {}))
        # The same key paths as spec_reference: a nested object's anchor comes from its path.
        prefix = _path_prefix(sections, anchor)
        for key, prop in node.get("properties", {}).items():
            type_text(prop, sections, f"{prefix}{key}")
        if isinstance(node.get("additionalProperties"), dict):
            type_text(node["additionalProperties"], sections, f"{prefix}<name>")
    return found


# ---- the known-failure catalog ---------------------------------------------------------------


def hints_table() -> str:
    """Every entry of the launcher's known-failure catalog: the exception, what in its message
    recognises it, and the `hint:` line the launcher prints, word for word."""
    from distlaunch.launcher.diagnosis import hints

    rows = [
        "| failure | exception | recognised by (in its message) | `hint:` the launcher prints |"
    ]
    rows.append("|---|---|---|---|")
    for hint in hints.CATALOG:
        types = ", ".join(f"`{t}`" for t in hint.types) or "any"
        pattern = hint.pattern.replace("`", "")
        rows.append(
            f"| `{hint.name}` | {types} | <code>{_cell(_html(pattern))}</code> | {_cell(hint.text)} |"
        )
    return "\n".join(rows) + "\n"


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---- the package tree for mkdocstrings ---------------------------------------------------------


def package_tree(out: Path = PACKAGES) -> Path:
    """Lay out the installed packages as folders of links to the source under ``out`` (pyproject's
    package-dir says where each package's files are) and return ``out``."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = mapping["package-dir"]
    for name, folder in sorted(folders.items(), key=lambda item: item[0].count(".")):
        target = out.joinpath(*name.split("."))
        source = REPO / folder
        if target.is_symlink():
            target.unlink()
        if name.count(".") == 0:
            # The root package: its own files, beside the links of its mapped subpackages.
            target.mkdir(parents=True, exist_ok=True)
            for path in source.iterdir():
                link = target / path.name
                if not link.is_symlink() and not link.exists():
                    link.symlink_to(path)
        elif not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source, target_is_directory=True)
    return out


# ---- the MkDocs hook ----------------------------------------------------------------------------


def on_startup(command: str, dirty: bool) -> None:
    """Before anything else of the build: the package tree mkdocstrings reads (its search paths
    are fixed when it starts, and a path that does not exist yet is left out)."""
    package_tree()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill a page's generated parts."""
    if SPEC_MARK in markdown:
        markdown = markdown.replace(SPEC_MARK, spec_reference(schema()))
    if HINTS_MARK in markdown:
        markdown = markdown.replace(HINTS_MARK, hints_table())
    return markdown
