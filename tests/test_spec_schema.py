"""`distlaunch schema`: the one statement of a valid spec. The committed checker is the schema
compiled again; every property says what it is (the reference docs are made from it); its
defaults are the model's; and every spec users are shown (cluster_specs/, the README, the docs)
passes it as the reference validator reads it."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from typing import Any

import jsonschema
import pytest

from conftest import REPO, distlaunch
from distlaunch.launcher.spec import files, model, schema
from distlaunch.launcher.spec.sources import read_yaml

pytestmark = pytest.mark.quick


def test_the_committed_checker_is_the_schema_compiled():
    pytest.importorskip("fastjsonschema", reason="compiling the schema needs fastjsonschema")
    from distlaunch.launcher.spec import compile as spec_compile

    assert spec_compile.CHECKER.read_text() == spec_compile.source(), (
        "spec/checker.py is stale: run `python -m distlaunch.launcher.spec.compile`"
    )


def test_schema_command_prints_a_valid_2020_12_schema():
    result = distlaunch("schema")
    assert result.returncode == 0, result.stderr
    published = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(published)
    assert published == model.json_schema()
    assert published["properties"]["backend"]["enum"][:1] == ["local"]


def _properties(node: Any, where: str = "$") -> list[tuple[str, dict]]:
    """Every named property of the schema, with where it is."""
    out = []
    if isinstance(node, dict):
        for name, prop in node.get("properties", {}).items():
            if isinstance(prop, dict):
                out.append((f"{where}.{name}", prop))
        for key, child in node.items():
            out += _properties(child, f"{where}/{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            out += _properties(child, f"{where}[{i}]")
    return out


def test_every_property_is_described():
    document = schema.document()
    # The properties of the spec and its $defs (not those inside if/then rules).
    # A role's count form is the `else` of its list form: its keys are the role's own.
    forms = re.compile(r"/\$defs/(role|one_task_role)/else/else")
    described = [
        (where, prop)
        for where, prop in _properties(document)
        if not re.search(r"/(if|then|else|allOf|anyOf|not)\b", forms.sub("", where))
    ]
    assert len(described) >= 80
    missing = [
        where for where, prop in described if "description" not in prop and "$ref" not in prop
    ]
    assert missing == []


def _defaults(node: dict) -> dict[str, Any]:
    return {k: p["default"] for k, p in node["properties"].items() if "default" in p}


@pytest.mark.parametrize(
    "kind,at",
    [
        (model.Host, ("$defs", "host")),
        (model.TaskEntry, ("$defs", "task")),
        (model.Timeouts, ("properties", "timeouts")),
        (model.Restart, ("properties", "restart")),
        (model.Kubernetes, ("properties", "kubernetes")),
        (model.Program, ("properties", "program")),
        (model.Spec, ()),
    ],
)
def test_the_schema_defaults_are_the_models(kind, at):
    node = schema.document()
    for key in at:
        node = node[key]
    for name, default in _defaults(node).items():
        found = {f.name: f for f in dataclasses.fields(kind)}[name]
        value = (
            found.default if found.default is not dataclasses.MISSING else found.default_factory()
        )
        if dataclasses.is_dataclass(value):
            value = {}  # a section's default: every key at its own default
        elif isinstance(value, tuple):
            value = list(value)
        assert value == default, (kind.__name__, name)


def _shown_specs() -> list[tuple[str, Any]]:
    """Specs users are shown: cluster_specs/*, and README and docs code blocks (json/yaml) that
    are specs or parts of one (every key a spec's, like `"tasks": ...`)."""
    found = []
    for path in sorted((REPO / "cluster_specs").glob("*")):
        if path.suffix in (".json", ".yaml", ".yml"):
            found.append((str(path), files.read(path, str(path)).raw))
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
    for page in pages:
        text = page.read_text()
        for match in re.finditer(r"^```(json|yaml)\n(.*?)^```", text, re.M | re.S):
            data = _block(match.group(1), match.group(2))
            line = text.count("\n", 0, match.start()) + 1
            if (
                isinstance(data, dict)
                and data
                and set(data) <= set(model.json_schema()["properties"])
            ):
                found.append((f"{page.relative_to(REPO)}:{line}", data))
    return found


def _block(kind: str, text: str) -> Any:
    """A code block's data; a JSON block may be part of an object (`"tasks": {...}`)."""
    try:
        if kind == "yaml":
            return read_yaml(text, "block").raw
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return json.loads("{" + text + "}")
    except (ValueError, model.SpecError):
        return None  # not a spec (a Kubernetes manifest, a shell session)


BASE = {
    "name": "t",
    "strategy": "multi_worker_mirrored",
    "program": {"module": "m"},
    "tasks": {"worker": {}},
}


def test_every_spec_users_are_shown_passes_the_schema():
    validator = jsonschema.Draft202012Validator(model.json_schema())
    shown = _shown_specs()
    assert len(shown) >= 8, [where for where, _ in shown]
    for where, data in shown:
        whole = {**BASE, **data}  # a part of a spec, in a minimal whole one
        errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(whole)]
        assert errors == [], where


def test_a_json_spec_and_plain_overrides_never_import_the_yaml_reader(tmp):
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({**BASE, "shared_dir": "runs"}))
    code = (
        "import sys\n"
        "from distlaunch.launcher.spec.model import load_spec\n"
        "from distlaunch.launcher.spec.sources import SpecOptions\n"
        f"load_spec({str(spec)!r}, SpecOptions(overrides=('tasks.worker.count=3', 'backend=local')))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('ruamel', 'yaml', 'fastjsonschema'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
