"""The default console holds what the program and distlaunch say, never TensorFlow's start noise
or a TensorFlow record's continuation lines (a ps or worker server's configuration dump); the log
files keep everything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO, distlaunch, only_run_dir
from distlaunch.launcher.core.console import QuietFilter, hide_tf_noise

# What a ParameterServerStrategy server writes when the chief connects (TF 2.21, seen here): one
# INFO record whose message is a protobuf dump, ended by an empty line. Its marker varies from
# one process to the next (protobuf picks goo.gle/debugonly, debugproto or debugstr).
SESSION_OPTIONS = (
    (
        b"I0000 00:00:1795603991.749105      87 eager_service_impl.cc:349] Creating sync eager "
        b"service context with rendezvous_id on host vm /job:ps/replica:0/task:0\n"
        b"I0000 00:00:1795603991.749170      87 eager_service_impl.cc:355] SessionOptions: "
        b"goo.gle/debugproto  \n"
    )
    + b"""\
device_count {
  key: "CPU"
  value: 1
}
device_count {
  key: "GPU"
  value: 0
}
gpu_options {
  experimental {
  }
}
allow_soft_placement: true
experimental {
  collective_group_leader: "/job:ps/replica:0/task:0"
}
pluggable_device_options {
  experimental {
  }
}

"""
)
# A status with its op context: the record goes on in lines that start with a tab.
END_OF_SEQUENCE = (
    b"2026-11-25 10:00:00.123456: I tensorflow/core/framework/local_rendezvous.cc:407] Local "
    b"rendezvous is aborting with status: OUT_OF_RANGE: End of sequence\n"
    b"\t [[{{node IteratorGetNext}}]]\n"
    b"\t [[RemoteCall]]\n"
)
# The program's own lines, some shaped like a dump's, one starting with a tab (not right after a
# record: that one would be taken for the record's op context).
PRINTED = b"serving\nconfig {\n  key: 1\n}\n\nloss: 0.25\n\tindented\n"
LOG = b"serving\n" + SESSION_OPTIONS + b"config {\n  key: 1\n}\n\n" + END_OF_SEQUENCE
LOG += b"loss: 0.25\n\tindented\n"


@pytest.mark.quick
@pytest.mark.parametrize("marker", [b"debugproto", b"debugstr", b"debugonly"])
def test_a_records_dump_and_op_context_are_dropped_and_the_programs_lines_kept(
    marker: bytes,
) -> None:
    assert hide_tf_noise(LOG.replace(b"debugproto", marker)) == PRINTED


@pytest.mark.quick
def test_a_record_cut_between_two_reads_is_dropped_whole() -> None:
    lines = LOG.splitlines(keepends=True)
    for first in range(len(lines) + 1):
        for second in range(first, len(lines) + 1):
            quiet = QuietFilter()
            pieces = (lines[:first], lines[first:second], lines[second:])
            shown = b"".join(quiet.filter(b"".join(piece)) for piece in pieces if piece)
            assert shown == PRINTED, (first, second)


# A console line (after its `task | ` prefix) that belongs to a protobuf dump.
_DUMP_LINE = re.compile(
    r"^\S+ *\| (?:\s*\w+ \{|\s*\}|\s+\w+: .*|allow_soft_placement: .*|.*goo\.gle/debug.*|\s*)$"
)


# What TensorFlow writes at its start, in every task's log.
_START_NOISE = re.compile(
    r"oneDNN|cuda|cuInit|absl|cpu_feature_guard|I0000|rebuild TensorFlow", re.IGNORECASE
)


def _dump_lines(console: str) -> list[str]:
    return [line for line in console.splitlines() if _DUMP_LINE.match(line)]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("spec", "printed", "dumped"),
    [
        ("local_ps.json", [("ps-0", "serving at"), ("chief-0", "final loss")], True),
        (
            "local_ps_eval.json",
            [("worker-0", "serving at"), ("chief-0", "final loss"), ("evaluator-0", "")],
            True,
        ),
        ("local2.json", [("worker-0", "final loss"), ("worker-1", "final loss")], False),
    ],
)
def test_up_consoles_hold_no_line_of_a_tensorflow_dump(
    tmp: Path, spec: str, printed: list[tuple[str, str]], dumped: bool
) -> None:
    # The PSS specs with one worker, not two: each server (ps, worker) dumps its own record when
    # the chief connects, so one of each shows the filtering; a second worker is a TensorFlow
    # start (seconds of CPU) that shows nothing more. MWMS keeps its two peers.
    workers = ["--set", "tasks.worker.count=1"] if spec != "local2.json" else []
    result = distlaunch(
        "up",
        str(REPO / "cluster_specs" / spec),
        "--fresh",
        "--set",
        f"shared_dir={tmp / 'runs'}",
        "--set",
        'program.args=["--epochs","2","--steps-per-epoch","5"]',
        *workers,
        cwd=tmp,
    )
    console = result.stdout + result.stderr
    assert result.returncode == 0, console
    assert _dump_lines(console) == [], console
    # ...nor a line of TensorFlow's start (oneDNN, CUDA, absl), nor a live line (piped).
    assert not _START_NOISE.search(console), console
    assert "\x1b[K" not in console
    for task, text in printed:  # the program's own lines are still there
        assert re.search(rf"^{task} *\| .*{text}", console, re.MULTILINE), console
    logs = [
        log.read_text() for log in (only_run_dir(tmp / "runs") / "logs" / "attempt-0").glob("*.log")
    ]
    # The logs keep everything: each task's start noise, and here each server's dump.
    for text in logs:
        assert "absl::InitializeLog" in text and "cpu_feature_guard" in text and "cuInit" in text
    assert ("goo.gle/debug" in "".join(logs) and "device_count {" in "".join(logs)) == dumped
