"""Hostile spec input: YAML and `--set` values that expand (aliases, long keys, big texts) and odd
host-file values end in one short line and exit 2, within a memory limit far below what the
expansion would take; never a traceback nor a MemoryError."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import distlaunch

# The address space `validate` runs in: a spec that expanded (2.4 GB for the first bomb below
# before the bounds) ends in a MemoryError under it; a bounded one needs about 60 MB of RSS.
LIMIT_BYTES = 400 << 20
HEAD = """\
name: t
strategy: multi_worker_mirrored
program: {script: task.py}
tasks: {worker: {count: 1}}
"""


def _tree(levels: int, width: int = 10) -> str:
    """A flow list whose last item expands to width**levels leaves through aliases."""
    items = [f"&a0 [{', '.join(['1'] * width)}]"]
    items += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"[{', '.join(items)}]"


def _keyed_tree(key: str, levels: int, width: int = 10) -> str:
    """Mappings with ``key`` at every level, each level ``width`` aliases of the one below."""
    lines = ["b0: &b0 {x: 1}"]
    for i in range(1, levels + 1):
        lines += [f"b{i}: &b{i}", f"  ? {key}", f"  : [{', '.join([f'*b{i - 1}'] * width)}]"]
    return "\n".join(lines) + "\n"


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def _validate(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp / "task.py").write_text("print('hi')\n")
    return subprocess.run(
        [sys.executable, "-m", "distlaunch.launcher", "validate", *args],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limited,
    )


def _one_short_line(result: subprocess.CompletedProcess, says: str, limit: int = 300) -> None:
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-2000:]
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in out, out[-2000:]
    assert len(line) < limit, line[:2000]
    assert says in line, line


@pytest.mark.quick
def test_the_bounded_limit_fits_a_good_spec(tmp: Path) -> None:
    (tmp / "spec.yaml").write_text(HEAD)
    result = _validate(tmp, "spec.yaml")
    assert result.returncode == 0, result.stderr


@pytest.mark.quick
@pytest.mark.parametrize(
    ("text", "says"),
    [
        # one 20,000-character key over a 5-level alias tree (20 KB; 60 KB: a MemoryError)
        (HEAD + f"? {'K' * 20_000}\n: {_tree(5)}\n", "expected keys of at most 256 characters"),
        (HEAD + f"? {'K' * 60_000}\n: {_tree(5)}\n", "expected keys of at most 256 characters"),
        # keys of an allowed length, repeated in every path the aliases make
        (HEAD + _keyed_tree("K" * 250, 5), "once aliases expand"),
        # a million values from 400 bytes
        (HEAD + f"x: {_tree(6)}\n", "once aliases expand"),
        # an alias tree as a key: never built into a value, nor shown
        (HEAD + f"b: {_tree(4)}\n? *a3\n: 1\n", "expected string keys, got a sequence"),
        (HEAD + "#" * (1 << 20), "expected a YAML spec of at most 1 MiB"),
    ],
    ids=["long key 20 KB", "long key 60 KB", "keyed tree", "alias tree", "tree as key", "1 MiB"],
)
def test_yaml_bombs_end_in_one_line(tmp: Path, text: str, says: str) -> None:
    (tmp / "spec.yaml").write_text(text)
    _one_short_line(_validate(tmp, "spec.yaml"), says)


def test_a_set_bomb_ends_in_one_line(tmp: Path) -> None:
    (tmp / "spec.yaml").write_text(HEAD)
    bomb = _tree(9, width=9)  # 9**9 leaves, 300 characters
    result = _validate(tmp, "spec.yaml", "--set", f"name={bomb}")
    _one_short_line(result, "once aliases expand")
    assert result.stderr.startswith("distlaunch: error: --set name=[&a0 [1, 1"), result.stderr


def test_a_set_value_that_expands_within_bounds_still_works(tmp: Path) -> None:
    (tmp / "spec.yaml").write_text(HEAD)
    ok = _validate(tmp, "spec.yaml", "--set", 'program.args=[&a "--x", *a]')
    assert ok.returncode == 0, ok.stderr
    wrong = _validate(tmp, "spec.yaml", "--set", f"name={_tree(4)}")
    _one_short_line(wrong, "$.name: expected a string")


@pytest.mark.quick
@pytest.mark.parametrize("slots", ["²", "١", "9" * 5000])
def test_a_hostfile_slot_count_is_ascii_digits(tmp: Path, slots: str) -> None:
    (tmp / "hosts.txt").write_text(f"node1 slots={slots}\n")
    (tmp / "spec.yaml").write_text(
        HEAD.replace("{worker: {count: 1}}", "{worker: {per_host: 1}}")
        + "hostfile: hosts.txt\nhost_template: {user: alice}\n"
    )
    result = distlaunch("validate", "spec.yaml", cwd=tmp)
    _one_short_line(result, "hosts.txt:1: $.hostfile: expected slots to be an integer >= 1")


JSON_HEAD = '{"name": "t", "strategy": "multi_worker_mirrored", "tasks": {"worker": {"count": 1}}, '


@pytest.mark.quick
@pytest.mark.parametrize(
    ("text", "says"),
    [
        # JSON keys have no length bound of their own: the message shows a preview of the key
        (
            JSON_HEAD + '"program": {"script": "task.py"}, "%s": 1}' % ("K" * 20_000),
            "unknown key 'KKKK",
        ),
        # a script name longer than the OS takes (ENAMETOOLONG: a traceback before)
        (
            JSON_HEAD + '"program": {"script": "%s.py"}}' % ("a" * 300),
            "$.program.script: expected an existing script file",
        ),
    ],
    ids=["long JSON key", "long script name"],
)
def test_long_json_names_end_in_one_line(tmp: Path, text: str, says: str) -> None:
    (tmp / "spec.json").write_text(text)
    # An unknown key's line also lists the 19 keys a spec takes (about 250 characters).
    _one_short_line(_validate(tmp, "spec.json"), says, limit=500)
