"""Stops from Python give the launcher the deadline `distlaunch down` gives it (issue 36, item
3): timeouts.save_s + grace_s and the launcher's slack, never grace_s + 30 s. A stand-in program
(no TensorFlow) takes the stop notice and saves for longer than grace_s + 30 s: the stop waits
for the save, and the run ends as its tasks ended it, not killed ("lost", 137)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import standins

import distlaunch
from conftest import processes_of_run

pytestmark = pytest.mark.integration

# Longer than the old deadline (grace_s 0.5 + 30 s), well within save_s.
SAVE_S = 32
# It serves on its task port as a TensorFlow server would: the launcher holds a notice until a
# task can take it (its server is up), as for every task at its start.
SAVES_SLOWLY = (
    f"""
import os, signal, time

PreemptionCheckpointHandler = None  # what program_scan looks for: this program saves on a notice


def save(signum, frame):
    print("saving", flush=True)
    time.sleep({SAVE_S})
    print("saved", flush=True)
    os._exit(75)  # saved on the notice and stopped (worker/contract.py EXIT_PREEMPTED)


signal.signal(signal.SIGTERM, save)
"""
    + standins.listening(standins.ANY)
    + """
print("serving", flush=True)
while True:
    time.sleep(1)
"""
)


def test_run_stop_waits_for_a_save_longer_than_grace_plus_thirty_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "saver.py").write_text(SAVES_SLOWLY)
    spec = {
        "name": "saver",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "saver.py"},
        "tasks": {"worker": {"count": 1}},
        "timeouts": {"grace_s": 0.5, "save_s": 120, "startup_s": 600},
    }
    run = distlaunch.launch(spec, console=None)
    try:
        while "serving" not in run.logs("worker-0"):
            assert run.result is None, run.logs("worker-0")
            time.sleep(0.05)
        result = run.stop()
    finally:
        run.stop(save=False)
    log = run.logs("worker-0")
    assert "saved" in log.split("saving", 1)[1], log
    assert result.state != "lost" and result.exit_code != 128 + signal.SIGKILL, result
    assert processes_of_run(run.run_id) == []
