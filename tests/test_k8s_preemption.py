"""A pod's SIGTERM is a stop notice (issue 26, Kubernetes): the pod entrypoint as PID 1.

First the entrypoint as real processes here (`python -m distlaunch.host.k8s_entry`, programs
that stand in for a training program: they report their state in the status file as
distlaunch.worker does): where the SIGTERM goes for each `--notice`, the notice sent again once
a strategy is built, the exit code a podFailurePolicy sees. Then the generated pods on the Docker
engine (tests/test_k8s.py's `pods_on_docker`): a 2-worker MWMS `dw.fit` stopped with
`docker stop -t <terminationGracePeriodSeconds>` on every pod at once, as a node drain does, saves
one step on both workers and exits 75, which the manifest's podFailurePolicy replaces without
counting; the pods started again resume at exactly that step. A plain script that cannot save
is stopped at once and exits as contract.EXIT_CODES says.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import wait_for
from distlaunch.launcher.transports.compose.docker import docker
from distlaunch.worker import contract
from test_compose import engine, image  # noqa: F401  (fixtures: the engine, the image)
from test_k8s import _manifests, job_templates, pod_failure_action, pods_on_docker  # noqa: F401

# Writes the status file as distlaunch.worker's runtime.report does.
REPORT = """
import json, os, sys, time
def report(state):
    path = os.environ["DISTLAUNCH_STATUS_FILE"]
    with open(path + ".tmp", "w") as f:
        json.dump({"state": state, "time": time.time(), "pid": os.getpid()}, f)
    os.replace(path + ".tmp", path)
"""

# A data loader's worker: notes any SIGTERM it gets.
CHILD = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1] + ".term", "w").close())
open(sys.argv[1], "w").write(str(os.getpid()))
while True:
    time.sleep(1)
"""

# A program that saves on a notice (program_scan: it would import distlaunch.worker): while it
# "builds its strategy" (status "starting") a SIGTERM is swallowed, as TensorFlow's own handler
# does; once built ("ready") its handler saves and exits 42 (TensorFlow's handler's code).
SAVER = (
    REPORT
    + """
import signal, subprocess
run = os.environ["DISTLAUNCH_RUN_DIR"]
subprocess.Popen([sys.executable, "-c", sys.argv[1], os.path.join(run, "child")])
report("starting")
signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(run, "swallowed"), "a").close())
while not os.path.exists(os.path.join(run, "go")):
    time.sleep(0.05)
def save(*_):
    open(os.path.join(run, "saved"), "w").close()
    os._exit(42)
signal.signal(signal.SIGTERM, save)
report("ready")
while True:
    time.sleep(0.05)
"""
)

# A program that leaves SIGTERM alone and cannot save, with a child.
PLAIN = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], "child")])
while True:
    time.sleep(0.05)
"""


def _entry(tmp: Path, role: str, notice: list[str], program: str, log: Path) -> subprocess.Popen:
    """The pod entrypoint of task ``role``:0 running ``program`` (Python source, CHILD its arg)."""
    run_dir = tmp / "run"
    run_dir.mkdir(exist_ok=True)
    cluster = {"chief": ["c-0.s:2222"], "worker": ["w-0.s:2222"], "ps": ["p-0.s:2222"]}
    environ = {
        "PATH": os.environ["PATH"],
        contract.ROLE: role,
        contract.JOB_COMPLETION_INDEX: "0",
        contract.CLUSTER: json.dumps(cluster),
        contract.RUN_DIR: str(run_dir),
    }
    with open(log, "w") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distlaunch.host.k8s_entry",
                "--notice",
                *notice,
                "--",
                sys.executable,
                "-c",
                program,
                CHILD,
            ],
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _child(run_dir: Path) -> psutil.Process:
    return psutil.Process(int(wait_for(lambda: _text(run_dir / "child"), "the child to start")))


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _stop(proc: subprocess.Popen, child: psutil.Process | None) -> None:
    for p in (proc, child):
        try:
            if p is not None:
                p.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass


@pytest.mark.quick
def test_the_notice_reaches_the_program_alone_again_once_built_and_42_reads_75(tmp):
    log = tmp / "entry.log"
    entry = _entry(tmp, "worker", ["program"], SAVER, log)
    run_dir, child = tmp / "run", None
    try:
        child = _child(run_dir)
        status = run_dir / "status" / "worker-0.json"
        wait_for(lambda: "starting" in _text(status), "the program to start building")
        entry.send_signal(signal.SIGTERM)
        # TensorFlow's handler (here: the program's while "starting") swallowed the notice ...
        wait_for(lambda: (run_dir / "swallowed").exists(), "the first notice")
        (run_dir / "go").touch()
        # ... so it comes again once the strategy is built, and the program saves.
        code = entry.wait(timeout=120)
    finally:
        _stop(entry, child)
    assert (run_dir / "saved").exists(), _text(log)
    # 42 after a notice is "preempted" (contract.EXIT_CODES): the pod exits 75, which the
    # manifest's podFailurePolicy replaces without counting.
    assert code == contract.EXIT_PREEMPTED, _text(log)
    assert not (run_dir / "child.term").exists(), "the data loader's child got the notice"


@pytest.mark.quick
def test_a_program_that_cannot_save_is_stopped_with_its_children(tmp):
    log = tmp / "entry.log"
    entry = _entry(tmp, "worker", ["group"], PLAIN, log)
    child = None
    try:
        child = _child(tmp / "run")
        entry.send_signal(signal.SIGTERM)
        code = entry.wait(timeout=120)
    finally:
        _stop(entry, child)
    # Death by SIGTERM: 128+15, which no rule ignores (the run stops unsaved, as before); the
    # whole process group had it (in a pod, the container's end then takes what is left).
    assert code == 128 + signal.SIGTERM, _text(log)
    wait_for(lambda: (tmp / "run" / "child.term").exists(), "the child to get SIGTERM")


@pytest.mark.quick
@pytest.mark.parametrize("chief_saves", [True, False], ids=["chief-saved", "deadline"])
def test_a_pss_server_serves_until_its_chief_has_saved(tmp, chief_saves):
    chief_status = tmp / "run" / "status" / "chief-0.json"
    chief_status.parent.mkdir(parents=True)
    # The previous chief's status: "preempted" from an earlier notice must not count.
    chief_status.write_text(json.dumps({"state": "preempted", "time": 1.0, "saved_step": 5}))
    log = tmp / "entry.log"
    save_s = "600" if chief_saves else "0.5"
    entry = _entry(tmp, "ps", ["chief", "--save-s", save_s], PLAIN, log)
    child = None
    try:
        child = _child(tmp / "run")
        entry.send_signal(signal.SIGTERM)
        wait_for(lambda: "a stop notice (chief)" in _text(log), "the notice")
        if chief_saves:
            # The server runs the chief's last steps: nothing stops it before the chief saved.
            assert entry.poll() is None and child.is_running()
            new = {"state": "preempted", "time": time.time(), "saved_step": 9}
            (tmp / "new.json").write_text(json.dumps(new))
            (tmp / "new.json").replace(chief_status)  # whole, as runtime.report writes it
        code = entry.wait(timeout=120)
    finally:
        _stop(entry, child)
    out = _text(log)
    if chief_saves:
        assert "the chief saved: this server stops" in out
        assert code == contract.EXIT_PREEMPTED, out
    else:
        assert "the chief did not save within 0.5 s" in out
        assert code == 128 + signal.SIGTERM, out


# ---- the generated pods on the Docker engine ---------------------------------------------------

ARGS = ["--epochs", "400", "--steps-per-epoch", "25", "--checkpoint-every", "100000"]


def _steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"^epoch \d+/\d+ step (\d+)", log, re.M)]


@pytest.mark.integration
@pytest.mark.timeout(1200)  # the image may be built first (test_compose.py)
def test_a_drain_of_mwms_pods_saves_one_step_and_the_restarted_pods_resume_there(
    pods_on_docker,  # noqa: F811  (the fixture)
    tmp,
    capsys,
):
    fields = {
        "program": {"module": "distlaunch.worker.examples.mnist_mlp", "args": ARGS},
        "timeouts": {"save_s": 120, "grace_s": 5},
    }
    objects, run_id = _manifests(tmp, **fields)
    (job,) = [job for obj in objects for _, job in job_templates(obj)]
    grace = job["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == 125
    pods = pods_on_docker.start(objects, "dl-test")
    wait_for(
        lambda: all(_steps(pods_on_docker.logs(c))[-1:] > [25] for c in pods.values()),
        "both pods to train past step 25",
        limit_s=600,
    )
    # A drain: every pod gets SIGTERM at once, and SIGKILL after the manifest's grace.
    stops = [
        subprocess.Popen(["docker", "stop", "-t", str(grace), c], stdout=subprocess.DEVNULL)
        for c in pods.values()
    ]
    for stop in stops:
        stop.wait()
    codes = {host: pods_on_docker.wait(c) for host, c in pods.items()}
    logs = {host: pods_on_docker.logs(c) for host, c in pods.items()}
    assert codes == dict.fromkeys(pods, contract.EXIT_PREEMPTED), logs
    saved = [int(s) for log in logs.values() for s in re.findall(r"saved step (\d+)", log)]
    assert len(saved) == 2 and saved[0] == saved[1] > 25, logs
    step = saved[0]
    # What the Job does with such a pod: a replacement, not counted against backoffLimit.
    assert pod_failure_action(job, contract.EXIT_PREEMPTED) == "Ignore"

    # The Job's replacements: the same pods again (names, hostnames), on the same volume.
    docker("rm", *pods.values())
    again = pods_on_docker.start(objects, "dl-test")
    wait_for(
        lambda: all(_steps(pods_on_docker.logs(c)) for c in again.values()),
        "the replacements to train a step",
        limit_s=600,
    )
    resumed = {
        host: re.findall(r"resumed from \S+ at step (\d+)", pods_on_docker.logs(c))
        for host, c in again.items()
    }
    assert resumed == dict.fromkeys(again, [str(step)]), resumed
    with capsys.disabled():
        print(f"\nk8s pods on docker, drained: both saved step {step}, exit 75; resumed at {step}")


@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_a_program_that_cannot_save_in_a_pod_is_stopped_at_once_and_exits_per_the_table(
    pods_on_docker,  # noqa: F811  (the fixture)
    tmp,
):
    # A program whose source shows no way to save (program_scan): it gets no notice, only a stop.
    plain = {"module": "http.server", "args": ["8123", "--bind", "127.0.0.1"]}
    objects, run_id = _manifests(tmp, program=plain, tasks={"worker": {"count": 1}})
    (job,) = [job for obj in objects for _, job in job_templates(obj)]
    assert "group" in job["template"]["spec"]["containers"][0]["command"]
    grace = job["template"]["spec"]["terminationGracePeriodSeconds"]
    (container,) = pods_on_docker.start(objects, "dl-test").values()
    wait_for(lambda: "Serving HTTP" in pods_on_docker.logs(container), "the program to serve")
    subprocess.run(
        ["docker", "stop", "-t", str(grace), container], check=True, stdout=subprocess.DEVNULL
    )
    code = pods_on_docker.wait(container)
    # Died of the SIGTERM (a script as PID 1 would ignore it and be SIGKILLed: 137): a failure
    # by contract.EXIT_CODES, which the Job counts.
    assert code == 128 + signal.SIGTERM, pods_on_docker.logs(container)
    assert pod_failure_action(job, code) == "Count"


@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_a_drain_of_pss_pods_saves_on_the_chief_while_its_servers_wait(
    pods_on_docker,  # noqa: F811  (the fixture)
    tmp,
    capsys,
):
    fields = {
        "program": {"module": "distlaunch.worker.examples.mnist_mlp", "args": ARGS},
        "strategy": "parameter_server",
        "tasks": {"chief": {"count": 1}, "worker": {"count": 1}, "ps": {"count": 1}},
        "timeouts": {"save_s": 120, "grace_s": 5},
    }
    objects, run_id = _manifests(tmp, **fields)
    jobs = {name: job for obj in objects for name, job in job_templates(obj)}
    grace = jobs[f"{run_id}-chief"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pods = pods_on_docker.start(objects, "dl-test")
    chief = f"{run_id}-chief-0"
    wait_for(
        lambda: _steps(pods_on_docker.logs(pods[chief]))[-1:] > [25],
        "the chief to train past step 25",
        limit_s=600,
    )
    stops = [
        subprocess.Popen(["docker", "stop", "-t", str(grace), c], stdout=subprocess.DEVNULL)
        for c in pods.values()
    ]
    for stop in stops:
        stop.wait()
    codes = {host: pods_on_docker.wait(c) for host, c in pods.items()}
    logs = {host: pods_on_docker.logs(c) for host, c in pods.items()}
    # The chief saved; its ps and worker served its last steps until then, and stopped after.
    assert codes == dict.fromkeys(pods, contract.EXIT_PREEMPTED), logs
    (step,) = [int(s) for s in re.findall(r"saved step (\d+)", logs[chief])]
    for host in pods:
        if host != chief:
            assert "the chief saved: this server stops" in logs[host], logs[host][-2000:]

    docker("rm", *pods.values())
    again = pods_on_docker.start(objects, "dl-test")
    wait_for(
        lambda: _steps(pods_on_docker.logs(again[chief])),
        "the new chief to train a step",
        limit_s=600,
    )
    resumed = re.findall(r"resumed from \S+ at step (\d+)", pods_on_docker.logs(again[chief]))
    assert resumed == [str(step)]
    with capsys.disabled():
        print(f"\nk8s PSS pods on docker, drained: the chief saved step {step}; resumed there")
