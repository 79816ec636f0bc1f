"""The README and the documentation pages stand on the repository alone, and the README stays a
short front page whose test command is the one CI runs.

A reader has the repository and nothing beside it, so a figure or document the README (or a
page of docs/) relies on must be in it or in the project. Checked: markdown links (the target must exist in the
repo), and every ``../`` or absolute path in the text, inline code and code blocks (it must not
resolve to a place beside the repo). Paths in JSON/YAML blocks are spec values: they resolve
against the spec's folder (cluster_specs/), as `up` resolves them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SPECS = REPO / "cluster_specs"
PAGES = sorted((REPO / "docs").rglob("*.md"))
# The README is a front page: what distlaunch is, install, the two commands, one spec, the
# commands, where each topic lives in the docs. The rest is in docs/.
README_MAX_LINES = 200

_FENCE = re.compile(r"^```(\w*)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path that climbs out of its folder, or an absolute one: after a space, quote, backtick or
# bracket, up to the next one.
_PATH = re.compile(r"""(?:^|(?<=[\s`"'(\[=]))((?:\.\./|/)[\w.~<>-][^\s`"'),;\]]*)""")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def outside_references(text: str, folder: Path = REPO) -> list[str]:
    """The links and paths of markdown ``text`` (a file in ``folder``) that leave the repository
    or name nothing in it, each as ``line N: reference (why)``."""
    found = []
    block = None  # the language of the fenced code block the line is in, or None outside one
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line.strip())
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block is None:
            for target in _LINK.findall(line):
                if _SCHEME.match(target) or target.startswith("#"):
                    continue
                path = (folder / target.split("#")[0]).resolve()
                if not path.is_relative_to(REPO):
                    found.append(f"line {number}: {target} (a link out of the repository)")
                elif not path.exists():
                    found.append(f"line {number}: {target} (a link to nothing in the repository)")
            line = _LINK.sub("]()", line)  # a link's target is checked once, as a link
        base = SPECS if block in ("json", "yaml") else folder
        for token in _PATH.findall(line):
            if token.startswith("/"):
                # An absolute path is a place on the user's machine, a host or a container;
                # it must not be one beside this checkout.
                path = Path(token).resolve()
                beside = path.is_relative_to(REPO.parent) and not path.is_relative_to(REPO)
            else:
                beside = not (base / token).resolve().is_relative_to(REPO)
            if beside:
                found.append(f"line {number}: {token} (a path out of the repository)")
    return found


def test_the_readme_links_and_paths_stay_inside_the_repository() -> None:
    assert outside_references(README.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_the_docs_links_and_paths_stay_inside_the_repository(page: Path) -> None:
    assert outside_references(page.read_text(), page.parent) == []


def test_the_readme_is_a_short_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_ci_runs_the_readmes_test_command_verbatim_as_its_last_step() -> None:
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    readme = README.read_text()
    two = readme.split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", two, re.S)[1].splitlines()
    assert ci[-1] in block and ci[-1] == "pip install -e '.[test]' && pytest"


def test_a_link_or_path_out_of_the_repository_is_named() -> None:
    text = (
        "See [the notes](../shared/FINDINGS.md) and [the spec](cluster_specs/nope.json).\n"
        "For comparison (../shared/FINDINGS.md): 10.7 s.\n"
        f"Or `{REPO.parent}/shared/FINDINGS.md`, but [this](cluster_specs/local2.json), `../runs`\n"
        "```json\n"
        '{"shared_dir": "../runs", "script": "../../elsewhere/task.py"}\n'
        "```\n"
        "[JobSet](https://jobset.sigs.k8s.io), `/distlaunch/runs`\n"
    )
    assert outside_references(text) == [
        "line 1: ../shared/FINDINGS.md (a link out of the repository)",
        "line 1: cluster_specs/nope.json (a link to nothing in the repository)",
        "line 2: ../shared/FINDINGS.md (a path out of the repository)",
        f"line 3: {REPO.parent}/shared/FINDINGS.md (a path out of the repository)",
        "line 3: ../runs (a path out of the repository)",
        "line 5: ../../elsewhere/task.py (a path out of the repository)",
    ]
