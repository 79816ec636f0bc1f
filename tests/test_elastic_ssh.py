"""Elastic runs on three SSH test hosts (tests/sshhosts.py), one real TensorFlow worker each
(dw.fit; tf_keras and Keras 3 model.fit), range 2:3: the third host's network goes away
mid-epoch (every packet of its cable dropped, both ways: no reset, no FIN), the run goes on in a
world of 2 from the latest checkpoint and finishes; when the network returns before the end, the
world grows back to 3 at a step the workers agree on, and no step is lost. Nothing of the run is
left on any host.

Host tests skip, with the reason, where the machine cannot make the hosts (not root, no sshd,
no nft). Times are printed, not asserted (bench/ measures them).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import sshhosts
from conftest import events, host_cmdlines, run_tables, wait_for, wait_for_run_dir

pytestmark = pytest.mark.integration

# Long enough that the world of 2 trains a while before the network returns, and the world of
# 3 after it. A global batch both 2 and 3 divide.
EPOCHS = 40
ARGS = ["--steps-per-epoch", "25", "--checkpoint-every", "25", "--global-batch-size", "48"]
ELASTIC = {
    "workers": "2:3",
    "lost_after_s": 5,
    "settle_s": 1,
    "interval_s": 1,
    "cooldown_s": 1,
    "probe_s": 1,
}
EPOCH_LINE = re.compile(r"^epoch \d+/\d+ step (\d+) loss (\S+)", re.M)


@pytest.fixture(scope="module")
def lab():
    """Three SSH test hosts."""
    reason = sshhosts.unavailable_reason()
    if reason is None and shutil.which("nft") is None:
        reason = "nft is not installed (apt-get install nftables)"
    if reason is not None:
        pytest.skip(reason)
    with sshhosts.HostLab(3) as made:
        yield made


# The same program three ways: dw.fit (Keras 3); tf_keras model.fit and Keras 3 model.fit (through
# distlaunch's layer), both with dw.keras_callbacks. A tf_keras backup's index names no step: the
# launcher then says "from the latest checkpoint", and the logs tell the step resumed.
PROGRAMS = {
    "dw_fit": ("keras3", []),
    "tf_keras": ("tf_keras", []),
    "keras3_model_fit": ("keras3", ["--model-fit"]),
}


def _spec(folder: Path, lab: sshhosts.HostLab, name: str, epochs: int = EPOCHS) -> Path:
    keras, flags = PROGRAMS[name]
    args = [*ARGS, "--epochs", str(epochs), *flags]
    program = {"module": "distlaunch.worker.examples.mnist_mlp", "args": args, "keras": keras}
    spec = {
        "name": "elastic",
        "strategy": "multi_worker_mirrored",
        "program": program,
        "hosts": {h.name: lab.host_entry(h) for h in lab.hosts},
        "tasks": {"worker": [{"host": h.name} for h in lab.hosts]},
        "shared_dir": "runs",
        "restart": {"policy": "on-failure", "max_restarts": 3, "backoff": {"initial_s": 0.5}},
        "elastic": ELASTIC,
        "timeouts": {"grace_s": 2, "startup_s": 180},
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec))
    return path


class Stall:
    """Every packet of a host's cable dropped, both ways, by a table of the test's own in the
    host's namespace (the run's own table is another: its agent removes that one as it ends)."""

    def __init__(self, host: sshhosts.TestHost) -> None:
        self.host = host
        leg = f"{host.netns}v"
        self.table = (
            "table inet dlstall {\n"
            f'  chain in {{ type filter hook input priority -100; iifname "{leg}" drop; }}\n'
            f'  chain out {{ type filter hook output priority -100; oifname "{leg}" drop; }}\n'
            "}\n"
        )
        self.on = False

    def add(self) -> float:
        nft = ["ip", "netns", "exec", self.host.netns, "nft", "-f", "-"]
        subprocess.run(nft, input=self.table, text=True, check=True)
        self.on = True
        return time.time()

    def remove(self) -> None:
        if self.on:
            nft = ["ip", "netns", "exec", self.host.netns, "nft", "delete", "table", "inet"]
            subprocess.run([*nft, "dlstall"], check=False)
            self.on = False


def _start(folder: Path, spec: Path) -> subprocess.Popen:
    import sys

    with open(folder / "stderr.txt", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "distlaunch.launcher", "up", str(spec)],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _epochs(run_dir: Path, attempt: int, task: str = "worker-0") -> list[tuple[int, float]]:
    log = run_dir / "logs" / f"attempt-{attempt}" / f"{task}.log"
    text = log.read_text() if log.exists() else ""
    return [(int(s), float(v)) for s, v in EPOCH_LINE.findall(text)]


def _resized(run_dir: Path) -> list[dict]:
    return [e for e in events(run_dir) if e.get("event") == "resized"]


def _resumed_at(run_dir: Path, attempt: int, task: str = "worker-0") -> int | None:
    log = run_dir / "logs" / f"attempt-{attempt}" / f"{task}.log"
    found = re.search(r"resumed from \S+ at step (\d+)", log.read_text() if log.exists() else "")
    return int(found.group(1)) if found else None


def _nothing_left(lab: sshhosts.HostLab) -> None:
    wait_for(
        lambda: all("distlaunch" not in host_cmdlines(lab, h) for h in lab.hosts),
        "every host to be empty of the run's processes",
        90,
    )
    for host in lab.hosts:
        assert run_tables(host) == [], host.name


def _shrunk(lab: sshhosts.HostLab, tmp: Path, launcher: subprocess.Popen, stall: Stall):
    """Train past step 50 in a world of 3, cut the third host's network, and wait for the world
    of 2 to train past its resumed step; return the run dir, the loss of attempt 0 and when."""
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    wait_for(lambda: [s for s, _ in _epochs(run_dir, 0) if s >= 50], "step 50", 300, launcher)
    cut_at = stall.add()
    [shrink] = wait_for(lambda: _resized(run_dir), "the world to shrink", 240, launcher)
    attempt = shrink["attempt"]
    resumed = wait_for(lambda: _resumed_at(run_dir, attempt), "the world of 2 to resume", 240)
    trained = wait_for(lambda: _epochs(run_dir, attempt), "the world of 2 to train", 240)
    print(
        f"host lost -> resized event {shrink['time'] - cut_at:.1f} s; -> first epoch of the "
        f"world of 2 {time.time() - cut_at:.1f} s (polled)"
    )
    return run_dir, shrink, resumed, trained


def _check_the_shrink(lab, err: str, name: str, run_dir: Path, shrink, resumed, trained) -> None:
    """The world of 3 became the first two hosts' world of 2 at the latest checkpoint, said so,
    and the loss went on from the checkpoint's."""
    assert (shrink["old"], shrink["new"]) == (3, 2)
    assert shrink["hosts"] == [lab.hosts[0].name, lab.hosts[1].name]
    assert f"{lab.hosts[2].name} lost" in shrink["reason"]
    assert resumed >= 50  # from the latest checkpoint, not from the start
    on = f"world 2 of 2:3 on {lab.hosts[0].name}, {lab.hosts[1].name} from"
    if name == "tf_keras":
        assert shrink["step"] is None and f"{on} the latest checkpoint" in err
    else:  # dw.fit's checkpoint index, the Keras 3 backup's metadata: both name the step
        assert shrink["step"] == resumed and f"{on} step {resumed}" in err
    # The loss goes on from the checkpoint's: nearer the loss at that step than the first one.
    before = dict(_epochs(run_dir, 0))
    first_loss = next(iter(before.values()))
    at_checkpoint = before[resumed]
    after = trained[0][1]
    assert abs(after - at_checkpoint) < abs(after - first_loss), (before, trained)


def _stop(launcher: subprocess.Popen, stall: Stall) -> None:
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
    stall.remove()


def _said(tmp: Path) -> str:
    err = (tmp / "stderr.txt").read_text()
    print("\n".join(line[:300] for line in err.splitlines() if line.startswith("distlaunch:")))
    return err


def test_a_host_lost_for_good_shrinks_the_world_and_the_run_finishes(lab, tmp: Path) -> None:
    # dw.fit: the Keras programs lose their host the same way in the test below, before it returns.
    stall = Stall(lab.hosts[2])
    launcher = _start(tmp, _spec(tmp, lab, "dw_fit", epochs=12))
    try:
        run_dir, shrink, resumed, trained = _shrunk(lab, tmp, launcher, stall)
        launcher.wait(timeout=600)
    finally:
        _stop(launcher, stall)
    err = _said(tmp)
    assert launcher.returncode == 0, err[-4000:]
    _check_the_shrink(lab, err, "dw_fit", run_dir, shrink, resumed, trained)
    assert "worlds: 3 -> 2 (elastic.workers 2:3, 1 resizes)" in err
    assert json.loads((run_dir / "run.json").read_text())["state"] == "succeeded"
    _nothing_left(lab)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_host_that_returns_grows_the_world_back_with_no_step_lost(
    lab, tmp: Path, name: str
) -> None:
    stall = Stall(lab.hosts[2])
    launcher = _start(tmp, _spec(tmp, lab, name))
    try:
        run_dir, shrink, resumed_on_2, trained = _shrunk(lab, tmp, launcher, stall)
        stall.remove()
        grown = wait_for(lambda: _resized(run_dir)[1:], "the world to grow", 300, launcher)
        launcher.wait(timeout=600)
    finally:
        _stop(launcher, stall)
    err = _said(tmp)
    assert launcher.returncode == 0, err[-4000:]
    _check_the_shrink(lab, err, name, run_dir, shrink, resumed_on_2, trained)
    grow = grown[0]
    assert (grow["old"], grow["new"]) == (2, 3)
    assert f"{lab.hosts[2].name} answers again" in grow["reason"]
    saving = [e for e in events(run_dir) if e.get("event") == "notice" and e.get("resize")]
    assert saving and saving[0]["attempt"] == shrink["attempt"]
    resumed = _resumed_at(run_dir, grow["attempt"])
    assert _resumed_at(run_dir, grow["attempt"], "worker-2") == resumed
    assert resumed > resumed_on_2  # the world of 2 trained on
    # The save at the agreed step is the step the world of 3 starts from: 0 steps lost.
    saved = {
        e.get("saved_step")
        for e in events(run_dir)
        if e.get("event") == "exited" and e.get("attempt") == shrink["attempt"]
    }
    assert saved == {grow["step"]} == {resumed}, saved
    assert "worlds: 3 -> 2 -> 3 (elastic.workers 2:3, 2 resizes)" in err
    assert json.loads((run_dir / "run.json").read_text())["state"] == "succeeded"
    _nothing_left(lab)
