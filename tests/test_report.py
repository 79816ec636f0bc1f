"""`distlaunch report`: a run told as a picture, checked as a browser shows it.

The real run is a real `up` of two stand-in tasks (no TensorFlow: each listens on its task port
as a server would, and beats and logs metrics through distlaunch.worker): worker-1 fails (a gang
restart), a SIGTERM to `up` is the stop notice on which both save, and the resumed run fails for
good (the root cause). Its report.html is opened in headless Chromium (Debian's `chromium`): a
screenshot is taken, and the page's SVG, as Chromium parsed it (--dump-dom), is counted: one row
per task, one bar per attempt, the notice's marker. The same for a synthetic run of 256 tasks
over 50 attempts (bench/report.py writes it, and times the report: no timing is asserted here).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
import standins

from conftest import REPO, distlaunch, events, only_run_dir, wait_for, write_spec
from distlaunch.launcher.report.story import Ending, read_story
from distlaunch.launcher.report.write import inline_html, write_report

sys.path.insert(0, str(REPO / "bench"))
from report import synthetic_run  # noqa: E402

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (apt install chromium)"
)

# The stand-in training program: attempt 0's worker-1 raises at step 30 (a gang restart); on
# SIGTERM (the stop notice) each task reports its save and exits 75; in attempt 2 worker-0 fails
# with an import error (never retried: the root cause).
STORY = (
    """
import math, signal
import distlaunch.worker as dw
from distlaunch.worker import contract, progress, runtime

ctx = dw.context()
"""
    + standins.listening(standins.ANY)
    + """
metrics = progress.MetricsLog(contract.env_path(contract.METRICS_FILE), keep_until_step=10**9)
step = first = metrics.entries[-1]["step"] if metrics.entries else 0
beat = progress.Heartbeat(total_steps=1000)

def save(signum, frame):
    runtime.report(contract.STATE_PREEMPTED, step=step, saved_step=step, save_s=0.01)
    print(f"stop notice: saved step {step}", flush=True)
    sys.exit(contract.EXIT_PREEMPTED)

signal.signal(signal.SIGTERM, save)
while True:
    time.sleep(0.05)
    step += 1
    loss = 2.0 * math.exp(-step / 60) + 0.05 * (ctx.index + 1)
    beat.update(loss=loss)
    beat.beat(step)
    if step % 10 == 0:
        metrics.append({"epoch": step // 10, "step": step, "loss": loss})
    if ctx.attempt == 0 and ctx.name == "worker-1" and step == 30:
        raise RuntimeError("injected failure at step 30")
    if ctx.attempt == 2 and ctx.name == "worker-0" and step == first + 20:
        import missing_module_of_the_story
"""
)


class _Svg(HTMLParser):
    """What a report's page holds, as a browser parsed it: rows, bars and markers."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[str] = []
        self.bars: list[tuple[str, int, str]] = []  # task, attempt, ending
        self.markers: list[tuple[str, str | None]] = []  # kind, task
        self.timelines = 0
        self.lines: list[tuple[str, str, str]] = []  # chart, task, the polyline's points
        self._chart = self._task = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        classes = (found.get("class") or "").split()
        if tag == "svg" and "chart" in classes:
            self._chart = classes[1]
        elif tag == "g" and "series" in classes:
            self._task = found["data-task"] or ""
        elif tag == "polyline" and self._chart:
            self.lines.append((self._chart, self._task, found["points"] or ""))
        if tag == "svg" and "timeline" in classes:
            self.timelines += 1
        elif tag == "g" and "row" in classes:
            self.rows.append(found["data-task"])
        elif tag == "rect" and "bar" in classes:
            self.bars.append((found["data-task"], int(found["data-attempt"]), classes[1]))
        elif tag == "g" and "marker" in classes:
            self.markers.append((classes[1], found.get("data-task")))


def _in_chromium(page: Path, shot: Path) -> _Svg:
    """Open ``page`` in headless Chromium: take a screenshot into ``shot``, and return the SVG
    of the page's DOM as Chromium built it."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,1400"]
    url = page.resolve().as_uri()
    # One start of Chromium does both (each start costs seconds).
    dom = subprocess.run(
        [*args, f"--screenshot={shot}", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert shot.stat().st_size > 10_000  # a picture, not a blank page
    svg = _Svg()
    svg.feed(dom.stdout)
    return svg


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of the run dir, with its size and modification time."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in run_dir.rglob("*")
        if p.is_file()
    }


def _status(run_dir: Path, task: str) -> dict:
    try:
        return json.loads((run_dir / "status" / f"{task}.json").read_text())
    except (OSError, ValueError):
        return {}


@needs_chromium
def test_a_run_with_a_failure_a_gang_restart_and_a_preemption_told_as_a_picture(tmp, launch):
    (tmp / "task.py").write_text(STORY)
    restart = {"policy": "on-failure", "max_restarts": 3, "standby": False}
    restart["backoff"] = {"initial_s": 0, "max_s": 0}
    timeouts = {"grace_s": 2, "startup_s": 60, "save_s": 20}
    spec = write_spec(tmp, restart=restart, timeouts=timeouts)
    launcher = launch(spec)
    run_dir = wait_for(lambda: next((tmp / "runs").glob("*/run.json"), None), "run.json").parent

    def trained_in_attempt_1() -> bool:
        beats = [_status(run_dir, t) for t in ("worker-0", "worker-1")]
        return all(b.get("attempt") == 1 and b.get("step", 0) >= 60 for b in beats)

    wait_for(trained_in_attempt_1, "both workers to train in attempt 1", launcher=launcher)

    # While it runs: the report so far, marked running.
    running = distlaunch("report", str(run_dir))
    assert running.returncode == 0, running.stderr
    story = read_story(run_dir)
    assert story.live and story.state == "running"
    assert {(b.task, b.attempt, b.ending) for b in story.bars if b.attempt == 1} == {
        ("worker-0", 1, Ending.RUNNING),
        ("worker-1", 1, Ending.RUNNING),
    }
    assert "running: this report shows the run so far" in (run_dir / "report.html").read_text()

    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(120) == 75
    resumed = distlaunch("up", str(spec), "--resume", cwd=tmp)
    assert resumed.returncode == 1, resumed.stderr
    # `up` names the report of a failed run.
    assert f"the run as a picture: {run_dir / 'report.html'}" in resumed.stdout + resumed.stderr

    before = _files(run_dir)
    made = distlaunch("report", str(run_dir))
    assert made.returncode == 0, made.stderr
    page = Path(made.stdout.strip())
    assert page == run_dir / "report.html"
    after = _files(run_dir)
    # The run dir is only read: report.html is the one file written.
    assert {k: v for k, v in after.items() if k != "report.html"} == {
        k: v for k, v in before.items() if k != "report.html"
    }

    svg = _in_chromium(page, tmp / "report.png")
    assert svg.timelines == 1
    assert svg.rows == ["worker-0", "worker-1"]
    started = {
        (e["task"], e["attempt"]) for e in events(run_dir) if e["event"] in ("started", "restarted")
    }
    assert len(started) == 6  # 2 tasks x 3 attempts
    assert sorted((task, attempt) for task, attempt, _ in svg.bars) == sorted(started)
    endings = {(task, attempt): ending for task, attempt, ending in svg.bars}
    assert endings == {
        ("worker-0", 0): "killed",  # killed for worker-1's gang restart
        ("worker-1", 0): "failed",
        ("worker-0", 1): "preempted",
        ("worker-1", 1): "preempted",
        ("worker-0", 2): "failed",
        ("worker-1", 2): "stopped",
    }
    kinds = Counter(kind for kind, _ in svg.markers)
    # The gang restart, then the resume: each one line across the rows.
    assert kinds == {"notice": 1, "restart": 2, "save": 2, "root-cause": 1}
    assert [task for kind, task in svg.markers if kind == "restart"] == [None, None]
    assert ("root-cause", "worker-0") in svg.markers
    html = page.read_text()
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    record = json.loads((run_dir / "run.json").read_text())
    assert record["failure"]["summary"] in html.replace("&#x27;", "'")  # the summary line on top


@needs_chromium
def test_a_256_task_run_of_50_attempts_stays_one_row_per_task_and_one_bar_per_attempt(tmp):
    run_dir = synthetic_run(tmp / "run", tasks=256, attempts=50)
    svg = _in_chromium(write_report(run_dir), tmp / "report.png")
    assert svg.rows == [f"worker-{i}" for i in range(256)]
    per_task = Counter(task for task, _, _ in svg.bars)
    assert len(svg.bars) == 256 * 50 and set(per_task.values()) == {50}
    assert {attempt for _, attempt, _ in svg.bars} == set(range(50))
    kinds = Counter(kind for kind, _ in svg.markers)
    assert kinds["notice"] == 1 and kinds["save"] == 256 and kinds["hang"] == 1
    assert kinds["restart"] == 49  # one per gang restart, not one per task


def _run_dir(tmp: Path) -> Path:
    """A small finished run dir: two tasks, two attempts (synthetic)."""
    return synthetic_run(tmp / "run", tasks=2, attempts=2)


def test_no_run_dir_or_no_run_record_is_one_line_and_exit_2(tmp):
    missing = distlaunch("report", str(tmp / "nothing"))
    (tmp / "garbled").mkdir()
    (tmp / "garbled" / "run.json").write_text('{"run_id": "x", "tasks": [1, 2')
    garbled = distlaunch("report", str(tmp / "garbled"))
    (tmp / "odd").mkdir()
    (tmp / "odd" / "run.json").write_text('{"run_id": "x", "tasks": [1, 2]}')
    odd = distlaunch("report", str(tmp / "odd"))
    for result in (missing, garbled, odd):
        assert result.returncode == 2
        assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith("distlaunch: error: ")
    assert "garbled/run.json" in garbled.stderr and "odd/run.json" in odd.stderr
    assert not (tmp / "garbled" / "report.html").exists()


def test_events_and_metrics_cut_or_garbled_give_the_report_of_what_was_read_and_a_note(tmp):
    run_dir = _run_dir(tmp)
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    damaged = [lines[0], "{not json", *lines[1:], '{"time": "soon", "task": "worker-0"}']
    # The last line cut mid-line, as a reader finds it while the launcher writes it.
    (run_dir / "events.jsonl").write_text("\n".join(damaged) + '\n{"time": 1800000019.9, "ta')
    (run_dir / "metrics" / "worker-1.json").write_text('[{"step": 25, "loss": 1.0, "ti')
    result = distlaunch("report", str(run_dir))
    assert result.returncode == 0, result.stderr
    story = read_story(run_dir)
    assert story.notes == (
        "events.jsonl: 3 line(s) could not be read and are left out: line 2, "
        f"{len(damaged)}, {len(damaged) + 1} (cut mid-line)",
        "metrics/worker-1.json: not valid JSON (cut or garbled); left out",
    )
    assert len(story.bars) == 4 and story.series["worker-0"] and not story.series["worker-1"]
    html = (run_dir / "report.html").read_text()
    assert "metrics/worker-1.json: not valid JSON" in html


def test_a_notebook_shows_the_report_as_a_fragment_that_writes_nothing(tmp):
    run_dir = _run_dir(tmp)
    before = sorted(p.name for p in run_dir.iterdir())
    fragment = inline_html(run_dir)
    assert fragment.startswith('<div class="dlr">') and "<html" not in fragment
    assert '<svg class="timeline"' in fragment
    assert sorted(p.name for p in run_dir.iterdir()) == before


# A notebook's cells: a run of one task that fails (exit 3) at once, its report, then the Run
# itself as the cell's result.
FAILS_AT_ONCE = standins.listening(standins.ANY) + "sys.exit(3)\n"
NOTEBOOK = [
    f"""\
import json, pathlib
import distlaunch

pathlib.Path("task.py").write_text({FAILS_AT_ONCE!r})
spec = {{
    "name": "nb",
    "strategy": "multi_worker_mirrored",
    "program": {{"script": "task.py"}},
    "tasks": {{"worker": {{"count": 1}}}},
    "shared_dir": "runs",
}}
run = distlaunch.launch(spec, console=None)
run.wait(120).state""",
    "print(run.report())",
    "run",
]


def test_run_report_returns_its_path_and_a_notebook_shows_the_run_as_its_report(tmp_path: Path):
    # test_notebook skips its module where the test extras are missing, so this test does too.
    from test_notebook import executed

    ran, reported, shown = executed(NOTEBOOK, tmp_path)
    assert ran.outputs[0]["data"]["text/plain"] == "'failed'"
    (run_dir,) = [p.parent for p in tmp_path.glob("runs/*/run.json")]
    page = Path(reported.outputs[0]["text"].strip())
    assert page == run_dir / "report.html" and page.is_file()
    assert os.stat(page).st_mode & 0o077 == 0  # a private run's file, as every file of it
    (result,) = [o for o in shown.outputs if o["output_type"] == "execute_result"]
    html = result["data"]["text/html"]  # the cell shows the report, inline
    assert html.startswith('<div class="dlr">') and "<html" not in html
    svg = _Svg()
    svg.feed(html)
    assert svg.rows == ["worker-0"] and [(t, a) for t, a, _ in svg.bars] == [("worker-0", 0)]
    assert ("root-cause", "worker-0") in svg.markers
    assert result["data"]["text/plain"].startswith("<distlaunch.Run nb-")


# A task whose loss diverges for a while: metrics entries at steps 25-40 hold NaN and Infinity,
# as Python's json writes them (the file is no longer strict JSON), then it recovers.
DIVERGED = """
import math, time
from distlaunch.worker import contract, progress
metrics = progress.MetricsLog(contract.env_path(contract.METRICS_FILE), keep_until_step=10**9)
beat = progress.Heartbeat(total_steps=60)
for step in range(1, 61):
    time.sleep(0.02)
    loss = 2.0 * math.exp(-step / 20)
    if 20 < step <= 40:
        loss = float("nan") if step % 2 else float("inf")
    beat.update(loss=loss)
    beat.beat(step)
    if step % 5 == 0:
        metrics.append({"step": step, "loss": loss})
beat.beat(60, force=True)
"""


@needs_chromium
def test_a_diverged_loss_of_nan_and_infinity_is_drawn_as_a_gap_and_said(tmp):
    (tmp / "task.py").write_text(DIVERGED)
    spec = write_spec(tmp, tasks={"worker": {"count": 1}})
    ran = distlaunch("up", str(spec), cwd=tmp)
    assert ran.returncode == 0, ran.stderr
    run_dir = only_run_dir(tmp / "runs")
    assert "NaN" in (run_dir / "metrics" / "worker-0.json").read_text()  # as a user's run has it
    made = distlaunch("report", str(run_dir))
    assert made.returncode == 0 and made.stderr == "", made.stderr
    note = (
        "worker-0: 4 reading(s) with a loss or steps/s of NaN or Infinity (steps 25-40): "
        "drawn as gaps in the charts"
    )
    assert note in read_story(run_dir).notes
    html = (run_dir / "report.html").read_text()
    assert note in html
    svg = _in_chromium(run_dir / "report.html", tmp / "report.png")
    loss = [points for chart, task, points in svg.lines if chart == "loss" and task == "worker-0"]
    assert len(loss) == 2, loss  # the line before the divergence and the one after: a gap
    numbers = [float(n) for points in loss for pair in points.split() for n in pair.split(",")]
    assert numbers and all(math.isfinite(n) for n in numbers)
