"""The documentation cannot lie: its runnable examples run, and its generated parts are complete.

A page marks a code block runnable with an HTML comment on the line before its fence (unseen on
the site): ``<!-- runnable -->``, ``<!-- runnable: exit 2 -->`` (the exit code it must end with),
``<!-- runnable: spec fragment -->`` (keys of a spec, checked merged over
cluster_specs/local2.json), or ``<!-- runnable: file NAME -->`` (a file the page's specs name,
such as a host file: written beside them before they are checked). Each runs here against the real CLI and API, in a folder of its own
holding a copy of cluster_specs/:

- ``bash``: the block, as a bash script (``set -euo pipefail``), must exit 0 (or as marked);
- ``python``: the block as a script must exit 0 (a block of pytest tests runs under pytest);
- ``json``/``yaml``: a whole spec, or a fragment of one, must pass `distlaunch validate`.

Only what is cheap and meaningful is marked (one Python example trains on 2 real TensorFlow
workers); the pytest plugin's page example runs in tests/test_pytest_plugin.py. The test output
counts the examples. The spec reference (generated from `distlaunch schema`) and the hint
catalog (generated from launcher/diagnosis/hints.py) are checked for every key and every hint.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO

DOCS = REPO / "docs"
sys.path.insert(0, str(DOCS / "hooks"))
import reference  # noqa: E402

_MARK = re.compile(r"^<!-- runnable(?:: (?P<options>.*?))? -->$")
_FENCE = re.compile(r"^```(?P<lang>\w*)")
BASE_SPEC = REPO / "cluster_specs" / "local2.json"


@dataclass(frozen=True)
class Example:
    """A code block a page marks runnable."""

    page: str  # relative to docs/
    line: int  # of its fence
    lang: str
    code: str
    options: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}-{self.lang}"


def examples(folder: Path = DOCS) -> tuple[list[Example], list[str]]:
    """The runnable examples of the pages under ``folder``, and the markers on no code block."""
    found, stray = [], []
    for path in sorted(folder.rglob("*.md")):
        page = str(path.relative_to(folder))
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            mark = _MARK.match(line.strip())
            if not mark:
                continue
            fence = _FENCE.match(lines[number + 1]) if number + 1 < len(lines) else None
            if fence is None or not fence["lang"]:
                stray.append(f"{page}:{number + 1}")
                continue
            end = next(i for i in range(number + 2, len(lines)) if lines[i].startswith("```"))
            code = "\n".join(lines[number + 2 : end]) + "\n"
            found.append(Example(page, number + 2, fence["lang"], code, mark["options"] or ""))
    return found, stray


EXAMPLES, STRAY = examples()
# The files pages show (``file NAME``), by page: written beside that page's specs.
FILES = {
    (e.page, e.options.split(maxsplit=1)[1]): e.code
    for e in EXAMPLES
    if e.options.startswith("file ")
}
EXAMPLES = [e for e in EXAMPLES if not e.options.startswith("file ")]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder of its own for an example, with a copy of cluster_specs/."""
    shutil.copytree(REPO / "cluster_specs", tmp_path / "cluster_specs")
    return tmp_path


def _env() -> dict[str, str]:
    import os

    # `distlaunch` and `python` are this interpreter's, as an activated virtualenv has them.
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


def _validate(spec: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distlaunch.launcher", "validate", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _spec_file(example: Example, work: Path) -> Path:
    """The example as a spec file in ``work``'s cluster_specs/ (where the repository's specs
    are, so that relative paths resolve as they do for them)."""
    folder = work / "cluster_specs"
    for (page, name), text in FILES.items():
        if page == example.page:
            (folder / name).write_text(text)
    if "fragment" not in example.options:
        path = folder / f"docs-example.{'yaml' if example.lang == 'yaml' else 'json'}"
        path.write_text(example.code)
        return path
    if example.lang == "json":
        keys = json.loads("{" + example.code.strip().rstrip(",") + "}")
    else:
        keys = yaml.safe_load(example.code)
    path = folder / "docs-example.json"
    path.write_text(json.dumps({**json.loads(BASE_SPEC.read_text()), **keys}))
    return path


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_a_runnable_example_of_the_docs_runs(example: Example, work: Path) -> None:
    if example.lang in ("json", "yaml"):
        result = _validate(_spec_file(example, work))
        assert result.returncode == 0, f"{example.id}: {result.stdout}{result.stderr}"
        return
    if example.lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", example.code]
    elif example.lang == "python":
        script = work / ("test_example.py" if "def test_" in example.code else "example.py")
        script.write_text(example.code)
        argv = [sys.executable, str(script)]
        if "def test_" in example.code:
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    else:
        pytest.fail(f"{example.id}: no way to run a {example.lang!r} block")
    result = subprocess.run(argv, cwd=work, env=_env(), capture_output=True, text=True, timeout=600)
    expected = int(example.options.split()[1]) if example.options.startswith("exit") else 0
    assert result.returncode == expected, f"{example.id}:\n{result.stdout}\n{result.stderr}"


@pytest.mark.quick
def test_the_docs_mark_runnable_examples_only_on_code_blocks(request) -> None:
    assert STRAY == [], f"runnable markers on no code block: {STRAY}"
    kinds = {}
    for example in EXAMPLES:
        kinds[example.lang] = kinds.get(example.lang, 0) + 1
    counted = ", ".join(f"{n} {lang}" for lang, n in sorted(kinds.items()))
    # Shown in the test output, past pytest's capture: how many examples the docs run.
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"docs: {len(EXAMPLES)} runnable examples ({counted})")
    assert {"bash", "python", "json", "yaml"} <= set(kinds)
    assert ("backends/ssh.md", "hosts.txt") in FILES


@pytest.mark.quick
def test_a_marker_on_no_code_block_is_named(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text(
        "<!-- runnable -->\nplain text\n\n<!-- runnable: exit 2 -->\n```bash\nfalse\n```\n"
    )
    found, stray = examples(tmp_path)
    assert stray == ["page.md:1"]
    assert found == [Example("page.md", 5, "bash", "false\n", "exit 2")]


# ---- the spec reference ---------------------------------------------------------------------


def _section(page: str, anchor: str) -> str:
    """The text of the section with ``anchor`` in the generated ``page``."""
    start = page.index(f"{{#{anchor}}}")
    end = page.find("\n## ", start)
    return page[start : end if end != -1 else None]


def _missing_keys(schema: dict, page: str) -> list[str]:
    """Each object of ``schema`` whose section ``page`` lacks, and each key its section lacks."""
    missing = []
    for anchor, keys in reference.object_keys(schema).items():
        if f"{{#{anchor}}}" not in page:
            missing.append(f"section {anchor}")
            continue
        section = _section(page, anchor)
        missing += [f"{anchor}: {key}" for key in sorted(keys) if f"| `{key}` |" not in section]
    return missing


@pytest.mark.quick
def test_the_spec_reference_lists_every_key_of_distlaunch_schema() -> None:
    schema = reference.schema()
    assert reference.SPEC_MARK in (DOCS / "reference" / "spec.md").read_text()
    assert _missing_keys(schema, reference.spec_reference(schema)) == []
    keys = reference.object_keys(schema)
    # Every object of the schema is reached, the top level's keys among them.
    assert set(schema["properties"]) == keys["spec-top-level"]
    assert len(keys) > len(schema["properties"]) // 4


# A schema of every construct the generator reads; its keys must all come out.
SYNTHETIC = {
    "title": "Spec",
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "description": "The run's name."},
        "mode": {"enum": ["a", "b"], "default": "a"},
        "port": {"oneOf": [{"const": "auto"}, {"type": "integer", "minimum": 1, "maximum": 9}]},
        "limits": {"anyOf": [{"$ref": "#/$defs/Limits"}, {"type": "null"}], "default": None},
        "hosts": {"type": "object", "additionalProperties": {"$ref": "#/$defs/Host"}},
        "steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}, "minItems": 1},
        "inline": {"type": "object", "properties": {"deep": {"type": "boolean"}}},
    },
    "$defs": {
        "Limits": {
            "type": "object",
            "properties": {"run_s": {"type": "number", "exclusiveMinimum": 0}},
        },
        "Host": {
            "type": "object",
            "properties": {"address": {"type": "string"}, "limits": {"$ref": "#/$defs/Limits"}},
        },
        "Step": {"type": "object", "properties": {"every": {"type": ["integer", "null"]}}},
    },
}


@pytest.mark.quick
def test_the_spec_reference_generator_reads_every_json_schema_construct() -> None:
    page = reference.spec_reference(SYNTHETIC)
    assert _missing_keys(SYNTHETIC, page) == []
    assert "| `name` | string (min length 1) | required | The run's name. |" in page
    assert '| `mode` | `"a"` \\| `"b"` | `"a"` |' in page
    assert '| `port` | `"auto"` or integer (>= 1, <= 9) |' in page
    assert "| `limits` | [Limits](#spec-limits) or null | `null` |" in page
    assert "| `hosts` | map of names to [Host](#spec-host) |" in page
    assert "| `steps` | list of [Step](#spec-step) (min items 1) |" in page
    assert "Used at `limits`, `hosts.<name>.limits`." in page  # one section, both uses named
    assert "| `every` | integer or null |" in page and "| `deep` | boolean |" in page
    # A key or an object the page lacks is named.
    without = page.replace("| `run_s` |", "| `gone` |").replace("{#spec-step}", "")
    assert _missing_keys(SYNTHETIC, without) == ["spec-limits: run_s", "section spec-step"]


# ---- the hint catalog and the commands -------------------------------------------------------


@pytest.mark.quick
def test_the_troubleshooting_page_lists_every_hint_the_launcher_can_print() -> None:
    from distlaunch.launcher.diagnosis import hints

    assert reference.HINTS_MARK in (DOCS / "troubleshooting.md").read_text()
    table = reference.hints_table()
    for hint in hints.CATALOG:
        assert f"| `{hint.name}` |" in table
        assert " ".join(hint.text.split()).replace("|", "\\|") in table


@pytest.mark.quick
def test_the_commands_page_lists_every_command() -> None:
    from distlaunch.launcher.cli import cli

    page = (DOCS / "reference" / "commands.md").read_text()
    listed = set(re.findall(r"^\| `distlaunch ([a-z0-9-]+)", page, re.M))
    assert listed == set(cli.commands)
