"""Stop notices where tasks run elsewhere (issue 26): SSH hosts and containers.

The remote helper on its own first: ``notice`` sends SIGTERM to the task's program alone. Then
real 2-worker MWMS `dw.fit` runs on the SSH lab's two hosts (tests/sshhosts.py): SIGTERM to `up`
and `distlaunch down` each end the run preempted (75) with one saved step, read from the status
files the tasks wrote to the shared run dir, and `up --resume` goes on from exactly that step;
the same with one worker here and one on a host, a PSS chief on one host and its servers on the
other, and hosts that share no run dir (preempted, no step known).

In containers (a real Docker engine, tests/test_compose.py's image): `up --backend compose` of the
same program, SIGTERM to `up`, then `--resume`; and a `distlaunch compose` file run by hand with
`docker compose up`, one dw.fit container stopped with `docker stop -t N`: every worker saves, each
container exits 75; a plain MWMS script's container, which never stops on SIGTERM (TensorFlow
swallows it), is killed at the end of N: 137, a failure, by the exit-code table.

SSH-lab tests: run under `flock /tmp/dl-ssh.lock`. Docker tests hold conftest's docker_lock (the
same file as `flock /tmp/dl-docker.lock`: run them without that flock, which would make the
fixture wait for its own process).
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import standins

import sshhosts
from conftest import distlaunch, events, run_record, wait_for, write_spec
from distlaunch.launcher.spec.model import load_spec
from distlaunch.launcher.transports.compose import file as compose
from distlaunch.launcher.transports.compose.docker import compose_command, docker
from distlaunch.worker import contract
from test_compose import BASE_IMAGE, TEST_IMAGE, _leftovers, engine, image  # noqa: F401 (fixtures)
from test_preemption import (
    ARGS,
    PLAIN,
    _both_print,
    _chief_log,
    _resumed_steps,
    _run_dir,
    _saved_steps,
    _training,
)
from test_ssh import _nothing_left

HELPER = [sys.executable, "-m", "distlaunch.host.remote"]

# A data-loader child that notes a SIGTERM reaching it while its parent, the program, still runs:
# the helper sends what the program left behind SIGTERM once the program has exited (the child is
# then the helper's), which is no notice.
CHILD = """
import os, signal, sys, time
parent = os.getppid()
def noted(signum, frame):
    if os.getppid() == parent:
        open(sys.argv[1], "w").write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, noted)
open(sys.argv[1] + ".started", "w").write(str(os.getpid()))
while True:
    time.sleep(1)
"""

# dw.fit (tests/test_preemption.py's ARGS) with such a child.
FIT_WITH_CHILD = f"""
import os, subprocess, sys
import distlaunch.worker as dw
marker = os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], f"child-{{dw.context().name}}")
subprocess.Popen([sys.executable, "-c", {CHILD!r}, marker])
from distlaunch.worker.examples.mnist_mlp import main
main(sys.argv[1:])
"""

# Exits 143 on its notice, as a program's own SIGTERM handler does, once its child has started.
NOTED = f"""
import os, signal, subprocess, sys, time
marker = sys.argv[1]
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
subprocess.Popen([sys.executable, "-c", {CHILD!r}, marker])
while not os.path.exists(marker + ".started"):
    time.sleep(0.05)
print("up", flush=True)
time.sleep(600)
"""


# ---- the remote helper, on this machine -------------------------------------------------------


@pytest.mark.timeout(120)
def test_helper_notice_reaches_the_program_alone_and_the_helper_keeps_watching(tmp: Path) -> None:
    script = tmp / "noted.py"
    script.write_text(NOTED)
    child = tmp / "child"
    request = {"argv": [sys.executable, str(script), str(child)], "env": {}, "grace_s": 5}
    helper = subprocess.Popen(
        HELPER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        helper.stdin.write(json.dumps(request).encode() + b"\n")
        helper.stdin.flush()
        assert helper.stdout.readline() == b"up\n"
        helper.stdin.write(b"notice\n")
        helper.stdin.flush()
        out = helper.stdout.read()
        err = helper.stderr.read()
        helper.wait(timeout=60)
    finally:
        helper.kill()
        helper.wait()
    # The program's own handler ran and its exit code is relayed; its child never got the
    # notice (the helper then ended it, as it ends whatever a task leaves behind).
    assert helper.returncode == 143, (out, err)
    assert (tmp / "child.started").is_file()
    assert not child.exists()
    assert b"stopping the task" not in err  # a notice is no stop


# ---- real runs on the SSH lab -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(ssh_lab):
    """The module's SSH test hosts (conftest's ssh_lab)."""
    return ssh_lab


def _ssh_spec(folder: Path, lab: sshhosts.HostLab, hosts: dict | None = None) -> Path:
    """dw.fit with a data-loader child, one worker on each of ``hosts`` (default: the lab's)."""
    (folder / "task.py").write_text(FIT_WITH_CHILD)
    hosts = hosts or {h.name: lab.host_entry(h) for h in lab.hosts}
    spec = {
        "name": "sshpre",
        "strategy": contract.MWMS,
        "program": {"script": "task.py", "args": ARGS},
        "hosts": hosts,
        "tasks": {"worker": [{"host": name} for name in hosts]},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_ssh_notice_saves_one_step_and_resume_and_down_continue_from_it(
    lab: sshhosts.HostLab, tmp: Path, launch
) -> None:
    spec = _ssh_spec(tmp, lab)
    launcher = launch(spec)
    run_dir = _training(tmp)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=240)
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = _saved_steps(run_dir, 0)
    assert len(saved) == 2 and saved[0] == saved[1] > 25
    step = saved[0]
    # The step comes from the status files the remote tasks wrote into the shared run dir.
    record = run_record(run_dir)
    assert record["state"] == "preempted" and record["preempted"]["step"] == step
    assert f"run {record['run_id']} preempted at step {step}, saved in " in err
    assert {t["exit_code"] for t in record["tasks"].values()} == {contract.EXIT_PREEMPTED}
    assert [e["saved_step"] for e in events(run_dir) if e["event"] == "exited"] == [step, step]
    # The data-loader children on the hosts ran, and the notice never reached them.
    for task in ("worker-0", "worker-1"):
        assert (run_dir / f"child-{task}.started").is_file()
        assert not (run_dir / f"child-{task}").exists()
    wait_for(lambda: _nothing_left(lab, record["run_id"]), "nothing of the run left on the hosts")

    # `up --resume` starts at exactly that step on both hosts; `distlaunch down` is a notice too.
    resumed = launch(spec, "--resume")
    _training(tmp, attempt=1, past_step=step)
    down = distlaunch("down", record["run_id"], "--shared-dir", str(tmp / "runs"))
    resumed.wait(timeout=240)
    assert down.returncode == 0, down.stderr
    assert resumed.returncode == contract.EXIT_PREEMPTED, (tmp / "stderr.txt").read_text()[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs" / "attempt-1").glob("worker-*.log"))
    assert _resumed_steps(logs) == [step, step]
    again = _saved_steps(run_dir, 1)
    assert len(again) == 2 and again[0] == again[1] > step
    assert f"its tasks saved step {again[0]}" in down.stdout
    assert run_record(run_dir)["preempted"]["step"] == again[0]
    wait_for(lambda: _nothing_left(lab, record["run_id"]), "nothing of the run left on the hosts")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_run_on_this_machine_and_an_ssh_host_saves_one_step_on_both(
    lab: sshhosts.HostLab, tmp: Path, launch
) -> None:
    # One notice, each task through its own transport: taskinit's NOTICE here, the helper there.
    hosts = {
        "here": {"transport": "local", "address": lab.launcher_address},
        "node1": lab.host_entry(lab.hosts[0]),
    }
    launcher = launch(_ssh_spec(tmp, lab, hosts))
    run_dir = _training(tmp)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=240)
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = _saved_steps(run_dir, 0)
    assert len(saved) == 2 and saved[0] == saved[1] > 25
    assert run_record(run_dir)["preempted"]["step"] == saved[0]
    for task in ("worker-0", "worker-1"):
        assert (run_dir / f"child-{task}.started").is_file()
        assert not (run_dir / f"child-{task}").exists()


# A program that can save by its source (it imports distlaunch.worker: it gets the notice) but
# leaves SIGTERM to its default action: the notice kills it, nothing is saved. A stand-in (no
# TensorFlow: what is tested is the helper's exit code and the launcher's reading of it): it
# serves on its task port as TensorFlow's server would (the launcher holds a notice until a
# task's server is up), then says so and waits.
DIES_ON_NOTICE = (
    "import signal\nimport distlaunch.worker\n"
    + standins.listening(standins.ANY)
    + """signal.signal(signal.SIGTERM, signal.SIG_DFL)
print("serving", flush=True)
while True:
    time.sleep(1)
"""
)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_program_killed_by_the_notice_on_a_host_saved_nothing_and_says_so(
    lab: sshhosts.HostLab, tmp: Path, launch
) -> None:
    # Over SSH the helper must exit 143 for a death by SIGTERM (SSH carries no signal death),
    # which the exit-code table reads as "saved by its own handler". Its last line says what it
    # was: the run is stopped unsaved, as the same program on this machine is (-15).
    spec = json.loads(_ssh_spec(tmp, lab).read_text())
    (tmp / "task.py").write_text(DIES_ON_NOTICE)
    spec["program"] = {"script": "task.py"}
    (tmp / "spec.json").write_text(json.dumps(spec))
    launcher = launch(tmp / "spec.json")
    run_dir = _run_dir(tmp)
    _both_print(run_dir, "serving", "both tasks serving")
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=120)
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    record = run_record(run_dir)
    assert record["state"] == "interrupted"
    assert {name: t["exit_code"] for name, t in record["tasks"].items()} == {
        "worker-0": -signal.SIGTERM,
        "worker-1": -signal.SIGTERM,
    }
    assert "preempted" not in err
    wait_for(lambda: _nothing_left(lab, record["run_id"]), "nothing of the run left on the hosts")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_ssh_pss_chief_alone_gets_the_notice_and_saves(
    lab: sshhosts.HostLab, tmp: Path, launch
) -> None:
    node1, node2 = (h.name for h in lab.hosts)
    spec = json.loads(_ssh_spec(tmp, lab).read_text())
    spec.update(
        strategy=contract.PSS,
        program={"module": "distlaunch.worker.examples.mnist_mlp", "args": ARGS},
        tasks={"chief": [{"host": node1}], "worker": [{"host": node2}], "ps": [{"host": node2}]},
    )
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    launcher = launch(path)
    wait_for(lambda: "step 50 " in _chief_log(tmp, 0), "the chief to train 50 steps")
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=240)
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = [int(s) for s in re.findall(r"stop notice: saved step (\d+)", _chief_log(tmp, 0))]
    assert len(saved) == 1 and saved[0] >= 50
    run_dir = next((tmp / "runs").glob("*/run.json")).parent
    record = run_record(run_dir)
    assert record["state"] == "preempted" and record["preempted"]["step"] == saved[0]
    # Only the chief got the notice; its servers on node2 were stopped once it had saved.
    assert [e["task"] for e in events(run_dir) if e["event"] == "exited"] == ["chief-0"]
    assert all(record["tasks"][n]["state"] == "stopped" for n in ("ps-0", "worker-0"))
    wait_for(lambda: _nothing_left(lab, record["run_id"]), "nothing of the run left on the hosts")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_ssh_hosts_that_share_nothing_save_and_the_run_is_preempted_without_a_step(
    lab: sshhosts.HostLab, tmp: Path, launch
) -> None:
    # The tasks write their status files on their hosts' own disks: the launcher cannot read the
    # saved step, but the exit codes still say that every task saved.
    spec = _ssh_spec(tmp, lab)
    home = lab.private_dir / tmp.name  # each host has its own disk at this path
    data = json.loads(spec.read_text())
    data.update(shared_dir=str(home / "runs"), shared_dir_is_shared=False)
    spec.write_text(json.dumps(data))
    launcher = launch(spec)
    run_dir = _training(home)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=240)
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = _saved_steps(run_dir, 0)  # the logs come back over SSH
    assert len(saved) == 2 and saved[0] == saved[1] > 25
    record = run_record(run_dir)
    assert record["state"] == "preempted" and record["preempted"]["step"] is None
    assert f"run {record['run_id']} preempted on the notice; " in err
    wait_for(lambda: _nothing_left(lab, record["run_id"]), "nothing of the run left on the hosts")


@pytest.mark.quick
def test_a_compose_file_gives_a_program_that_saves_the_save_deadline_to_stop(tmp: Path) -> None:
    # `docker compose stop`/`down` of a file run by hand: Docker's SIGTERM is a notice to dw.fit,
    # which must have timeouts.save_s to save; a program that cannot save keeps grace_s.
    timeouts = {"grace_s": 2, "startup_s": 120, "save_s": 45}
    (tmp / "task.py").write_text(PLAIN)
    for program, grace in (
        ({"module": "distlaunch.worker.examples.mnist_mlp", "args": ARGS}, "45s"),
        ({"script": "task.py"}, "2s"),
    ):
        loaded = load_spec(write_spec(tmp, program=program, timeouts=timeouts))
        plan = compose.compose_plan(loaded, "t-1", tmp / "runs" / "t-1")
        data = compose.compose_file(loaded, plan, "img:tag", "1000:1000")
        assert {s["stop_grace_period"] for s in data["services"].values()} == {grace}


# ---- containers: a real Docker engine ---------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_compose_notice_saves_one_step_and_resume_continues_from_it(
    docker_lock,
    image,  # noqa: F811
    tmp: Path,
    launch,
    monkeypatch,
) -> None:
    monkeypatch.setenv("DISTLAUNCH_IMAGE", TEST_IMAGE)
    monkeypatch.setenv("DISTLAUNCH_BASE_IMAGE", BASE_IMAGE)
    (tmp / "task.py").write_text(FIT_WITH_CHILD)
    spec = write_spec(tmp, program={"script": "task.py", "args": ARGS})
    launcher = launch(spec, "--backend", "compose", "--fresh")
    run_dir = _training(tmp)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=300)
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = _saved_steps(run_dir, 0)
    assert len(saved) == 2 and saved[0] == saved[1] > 25
    step = saved[0]
    record = run_record(run_dir)
    assert record["state"] == "preempted" and record["preempted"]["step"] == step
    assert {t["exit_code"] for t in record["tasks"].values()} == {contract.EXIT_PREEMPTED}
    assert [e["saved_step"] for e in events(run_dir) if e["event"] == "exited"] == [step, step]
    # docker-init passed the notice to the program alone: the child in its container never got it.
    for task in ("worker-0", "worker-1"):
        assert (run_dir / f"child-{task}.started").is_file()
        assert not (run_dir / f"child-{task}").exists()
    assert _leftovers(record["compose"]["project"]) == ([], [])

    resumed = launch(spec, "--backend", "compose", "--resume")
    wait_for(lambda: len(_resumed_steps(_logs(run_dir, 1))) == 2, "both workers to resume")
    resumed.send_signal(signal.SIGINT)
    resumed.wait(timeout=300)
    assert _resumed_steps(_logs(run_dir, 1)) == [step, step]


def _logs(run_dir: Path, attempt: int) -> str:
    folder = run_dir / "logs" / f"attempt-{attempt}"
    return "".join(p.read_text() for p in sorted(folder.glob("worker-*.log")))


class _ByHand:
    """A `distlaunch compose` file of a 2-worker spec under `docker compose up`, run as a user
    would, in the background; `close` removes the project."""

    def __init__(self, tmp: Path, program: dict) -> None:
        spec = write_spec(tmp, program=program, timeouts={"grace_s": 2, "startup_s": 120})
        self.project = f"dlpre-{secrets.token_hex(3)}"
        self.run_dir = tmp / "runs" / self.project
        file = tmp / "compose.yml"
        made = distlaunch(
            "compose", str(spec), "-o", str(file), "--image", TEST_IMAGE,
            "--run-id", self.project, cwd=tmp,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        self.command = [*compose_command(), "-p", self.project, "-f", str(file)]
        self.output = tmp / "compose-up.txt"
        with open(self.output, "w") as out:
            self.up = subprocess.Popen(
                [*self.command, "up"], cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def container(self, service: str) -> str:
        """The id of the service's container, once it exists."""
        return wait_for(
            lambda: docker(
                "ps", "--all", "--quiet",
                "--filter", f"label=com.docker.compose.project={self.project}",
                "--filter", f"label=com.docker.compose.service={service}",
            ).strip(),
            f"the container of {service}",
        )  # fmt: skip

    def exit_code(self, service: str) -> int:
        """The exit code of the service's stopped container."""
        code = docker("inspect", "--format", "{{.State.ExitCode}}", self.container(service))
        return int(code.strip())

    def status(self, task: str) -> dict:
        """The status file the task wrote into the run dir ({} before it wrote one)."""
        path = contract.status_path(self.run_dir, "worker", int(task[-1]))
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def close(self) -> None:
        """Remove the project's containers and network; reap `compose up`."""
        subprocess.run([*self.command, "down", "--volumes", "--timeout", "1"], capture_output=True)
        if self.up.poll() is None:
            self.up.kill()
        self.up.wait()


@pytest.fixture
def by_hand(docker_lock, image, tmp: Path):  # noqa: F811
    """Start `_ByHand` runs; each is removed when the test ends."""
    made: list[_ByHand] = []

    def start(program: dict) -> _ByHand:
        made.append(_ByHand(tmp, program))
        return made[-1]

    yield start
    for run in made:
        run.close()


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_docker_stop_of_a_fit_container_saves_and_it_exits_75(by_hand) -> None:
    run = by_hand({"module": "distlaunch.worker.examples.mnist_mlp", "args": ARGS})
    wait_for(
        lambda: all(run.status(t).get("step", 0) > 25 for t in ("worker-0", "worker-1")),
        "both workers to train past step 25",
    )
    # SIGTERM, then up to 120 s to save (Docker's grace), as `docker compose stop` or a drained
    # machine sends it; the other worker learns of it in the step's all-reduce.
    stop = docker("stop", "--time", "120", run.container("worker-0"))
    assert stop.strip()
    run.up.wait(timeout=300)
    output = run.output.read_text()
    assert run.exit_code("worker-0") == contract.EXIT_PREEMPTED, output[-3000:]
    assert run.exit_code("worker-1") == contract.EXIT_PREEMPTED, output[-3000:]
    statuses = [run.status(t) for t in ("worker-0", "worker-1")]
    assert {s["state"] for s in statuses} == {contract.STATE_PREEMPTED}
    steps = {s[contract.SAVED_STEP] for s in statuses}
    assert len(steps) == 1 and steps.pop() > 25
    saved = [int(s) for s in re.findall(r"stop notice: saved step (\d+)", output)]
    assert len(saved) == 2 and saved[0] == saved[1]
    index = (run.run_dir / "checkpoints" / "checkpoint").read_text()
    assert f'model_checkpoint_path: "ckpt-{saved[0]}"' in index


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_docker_stop_of_a_plain_mwms_container_kills_it_a_failure(by_hand, tmp: Path) -> None:
    (tmp / "task.py").write_text(PLAIN)
    run = by_hand({"script": "task.py"})
    wait_for(
        lambda: (
            "serving" in run.output.read_text() and run.output.read_text().count("serving") == 2
        ),
        "both tasks to build their strategy",
    )
    # TensorFlow's own notifier swallows the SIGTERM: Docker kills the container after the grace.
    docker("stop", "--time", "3", run.container("worker-0"))
    code = run.exit_code("worker-0")
    assert code == 128 + signal.SIGKILL
    assert contract.exit_meaning(code, noticed=True) is contract.ExitMeaning.RESTARTABLE
