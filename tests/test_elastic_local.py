"""An elastic run on the local backend, with real TensorFlow workers: a slot whose restarts run
out is held out and the run goes on in a smaller world, from its checkpoint, to the end."""

from __future__ import annotations

import json
import re

from conftest import distlaunch, events, only_run_dir, run_record, write_spec

# worker-2 of a world of 3 fails at once, every time (no traceback: no crash loop is seen, so
# its restarts are spent one by one); in any other world every worker trains mnist_mlp.
PROGRAM = """
import os, sys
if os.environ.get("DISTLAUNCH_WORLD_SIZE") == "3" and os.environ["DISTLAUNCH_INDEX"] == "2":
    os._exit(3)
from distlaunch.worker.examples.mnist_mlp import main
main(sys.argv[1:])
"""

ARGS = ["--epochs", "2", "--steps-per-epoch", "4", "--checkpoint-every", "2"]


def test_restarts_exhausted_on_one_slot_shrink_the_world_and_the_run_finishes(tmp):
    (tmp / "task.py").write_text(PROGRAM)
    spec = write_spec(
        tmp,
        program={"script": "task.py", "args": ARGS},
        tasks={"worker": {"count": 3}},
        restart={"policy": "on-failure", "max_restarts": 1, "backoff": {"initial_s": 0.1}},
        elastic={"workers": "2:3", "settle_s": 0, "cooldown_s": 600},
        timeouts={"grace_s": 2, "startup_s": 180},
    )
    done = distlaunch("up", str(spec), cwd=tmp, timeout=600)
    err = done.stderr
    assert done.returncode == 0, err[-4000:]
    assert "(attempt 0): 3 tasks (elastic.workers 2:3), multi_worker_mirrored" in err
    assert "worker-2@localhost held out: restart budget exhausted" in err
    assert "world 2 of 2:3 on localhost" in err
    run_dir = only_run_dir(tmp / "runs")
    [resized] = [e for e in events(run_dir) if e["event"] == "resized"]
    assert (resized["old"], resized["new"]) == (3, 2)
    assert "worker-2@localhost held out (restart budget exhausted)" in resized["reason"]
    record = run_record(run_dir)
    assert record["state"] == "succeeded"
    world = record["world"]
    assert world["size"] == 2 and world["worlds"] == [3, 2]
    assert world["slots"] == {"worker-0": "worker-0", "worker-1": "worker-1"}
    assert world["out"] == {"worker-2@localhost": "held out"}
    last = record["attempt"]
    assert resized["attempt"] == last  # the world of 2 is the last attempt
    logs = run_dir / "logs" / f"attempt-{last}"
    assert sorted(p.name for p in logs.iterdir()) == ["worker-0.log", "worker-1.log"]
    finals = [re.search(r"final loss (\S+)", p.read_text()) for p in sorted(logs.iterdir())]
    assert all(finals) and finals[0].group(1) == finals[1].group(1)  # one model, two workers
    status = json.loads((run_dir / "status" / "worker-1.json").read_text())
    assert status["attempt"] == last
    assert "worlds: 3 -> 2 (elastic.workers 2:3, 1 resizes)" in err
    # `status` shows the world; the report's timeline marks the resize.
    shown = distlaunch("status", str(run_dir), cwd=tmp)
    assert "world 2 of 2:3 on localhost (worlds 3 -> 2; out: worker-2@localhost held out)" in (
        shown.stdout
    )
    assert "worker-2 " not in shown.stdout  # a worker of the world of 3 only
    report = distlaunch("report", str(run_dir), cwd=tmp)
    html = (run_dir / "report.html").read_text()
    assert report.returncode == 0 and 'class="marker resize"' in html
    assert "world 3 -&gt; 2 on localhost" in html


def test_below_the_minimum_the_run_fails_in_one_line_naming_what_is_out(tmp):
    (tmp / "task.py").write_text(PROGRAM)
    spec = write_spec(
        tmp,
        program={"script": "task.py", "args": ARGS},
        tasks={"worker": {"count": 3}},
        restart={"policy": "on-failure", "max_restarts": 1, "backoff": {"initial_s": 0.1}},
        elastic={"workers": "3:3", "settle_s": 0, "cooldown_s": 600},
        timeouts={"grace_s": 2, "startup_s": 180},
    )
    done = distlaunch("up", str(spec), cwd=tmp, timeout=600)
    assert done.returncode == 1, done.stderr[-4000:]
    [headline] = [line for line in done.stderr.splitlines() if " failed: " in line]
    assert "failed: worker-2 was left without the workers elastic.workers needs" in headline
    assert (
        "2 usable worker slots, too few for a world of elastic.workers 3:3: "
        "worker-2@localhost held out (restart budget exhausted)"
    ) in headline
    assert run_record(only_run_dir(tmp / "runs"))["state"] == "failed"
    assert "Traceback" not in done.stderr
