"""Spec ergonomics and progress: YAML specs, --set overrides, host files and per_host,
forward_env on every backend, the console's TensorFlow noise filter, status --watch and the live
line of `up`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import standins

from conftest import distlaunch, only_run_dir, run_record, wait_for, write_spec
from distlaunch.launcher.core.console import Console, LogFollower, hide_tf_noise
from distlaunch.launcher.spec.model import load_spec

GOOD_YAML = """\
name: t
strategy: multi_worker_mirrored
program:
  script: task.py
  args: ["--epochs", "2"]
tasks:
  worker:
    count: 2
shared_dir: runs
"""

# What a task prints of its environment: the forwarded names, and one that must not arrive.
PRINT_ENV = """
import json, os
names = ["NCCL_DEBUG", "WANDB_API_KEY", "HF_HOME", "UNRELATED_VAR"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in names}), flush=True)
"""
LAUNCHER_ENV = {
    "NCCL_DEBUG": "INFO",
    "WANDB_API_KEY": "s3cret-key",
    "HF_HOME": "/hf",
    "UNRELATED_VAR": "no",
}
FORWARDED = {
    "NCCL_DEBUG": "INFO",
    "WANDB_API_KEY": "s3cret-key",
    "HF_HOME": "/hf",
    "UNRELATED_VAR": None,
}

# Real lines of a TensorFlow 2.20 task's start (absl's format) and TensorFlow's older format.
TF_NOISE_LINES = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"I0000 00:00:1795451252.187308    2737 cudart_stub.cc:31] Could not find cuda drivers on your "
    b"machine, GPU will not be used.",
    b"I0000 00:00:1795451252.486880    2737 cpu_feature_guard.cc:227] This TensorFlow binary is "
    b"optimized to use available CPU instructions in performance-critical operations.",
    b"To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with "
    b"the appropriate compiler flags.",
    b"E0000 00:00:1795451274.710989    2737 cuda_platform.cc:52] failed call to cuInit: INTERNAL: "
    b"CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    b"2024-01-19 12:34:56.789012: I tensorflow/core/util/port.cc:113] oneDNN custom operations are on.",
    b"2024-01-19 12:34:56.789012: E external/local_xla/xla/stream_executor/cuda/cuda_dnn.cc:9261] "
    b"Unable to register cuDNN factory: Attempting to register factory for plugin cuDNN",
]
KEPT_LINES = [
    b"W0000 00:00:1795451252.1    2737 collective_ops.cc:1] a warning nobody listed as harmless",
    b"epoch 1/3 step 20 loss 0.5",
]


def _yaml(tmp: Path, text: str, name: str = "spec.yaml") -> Path:
    (tmp / "task.py").write_text("print('hi')\n")
    path = tmp / name
    path.write_text(text)
    return path


# ---- YAML --------------------------------------------------------------------------------------


@pytest.mark.quick
def test_a_yaml_spec_is_the_same_spec_as_its_json(tmp: Path) -> None:
    from_yaml = load_spec(_yaml(tmp, GOOD_YAML + "hosts:\n  n1: {host_key_checking: yes}\n"))
    json_spec = write_spec(
        tmp,
        program={"script": "task.py", "args": ["--epochs", "2"]},
        hosts={"n1": {"host_key_checking": "yes"}},
        timeouts={},
    )
    assert from_yaml.spec == load_spec(json_spec).spec
    # YAML 1.1 would read `yes` as true; the spec's value is the string it means.
    assert from_yaml.spec.hosts["n1"].host_key_checking == "yes"


@pytest.mark.quick
@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        (
            GOOD_YAML.replace("count: 2", "count: two"),
            "spec.yaml:8: $.tasks.worker.count",
            "expected an integer",
        ),
        (
            GOOD_YAML.replace("  script: task.py", "  script: task.py\n  scirpt: x.py"),
            "spec.yaml:5: $.program.scirpt",
            "unknown key 'scirpt'",
        ),
        (
            GOOD_YAML.replace('args: ["--epochs", "2"]', "args: [--epochs, 2]"),
            "spec.yaml:5: $.program.args[1]",
            "expected a string, got 2",
        ),
        (GOOD_YAML + "name: again\n", "spec.yaml:10: $.name", "appears twice"),
        (GOOD_YAML.replace("tasks:", "tasks: [oops"), "spec.yaml:7: $", "invalid YAML"),
        (
            "a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n"
            + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)),
            "spec.yaml",
            "aliases expand",
        ),
    ],
    ids=["wrong type", "unknown key", "list item", "duplicate key", "syntax", "alias bomb"],
)
def test_yaml_errors_name_the_line_and_the_json_path(
    tmp: Path, text: str, where: str, says: str
) -> None:
    result = distlaunch("validate", str(_yaml(tmp, text).name), cwd=tmp)
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert where in line and says in line, line


# ---- --set overrides -----------------------------------------------------------------------------


@pytest.mark.quick
def test_overrides_change_the_spec_before_validation(tmp: Path) -> None:
    spec = _yaml(tmp, GOOD_YAML)
    ok = distlaunch("validate", str(spec), "--set", "tasks.worker.count=4", cwd=tmp)
    assert ok.returncode == 0 and "4 worker" in ok.stdout, ok.stderr
    plan = distlaunch(
        "plan",
        str(spec),
        "--json",
        "--set",
        'program.args=["--epochs","1"]',
        "--set",
        "tasks.worker.count=3",
        "--set",
        "program.env.MY_FLAG=on",
        cwd=tmp,
    )
    assert plan.returncode == 0, plan.stderr
    tasks = json.loads(plan.stdout)["tasks"]
    assert len(tasks) == 3
    assert tasks[0]["argv"][-2:] == ["--epochs", "1"]
    assert tasks[2]["env"]["MY_FLAG"] == "on"  # a YAML `on` is a string, not true


@pytest.mark.quick
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--set", "tasks.worker.count=0"],
            "$.tasks.worker.count: expected an integer from 1 to 4096, got 0 (set by --set tasks.worker.count=0)",
        ),
        (["--set", "program.args=[1]"], "(set by --set program.args=[1])"),
        (["--set", "strategy"], "--set 'strategy': expected KEY.PATH=VALUE"),
        (
            ["--set", "program.args.x=1"],
            "$.program.args.x: --set program.args.x=1: no such place in the spec",
        ),
    ],
    ids=["invalid value", "invalid list item", "no value", "not an object"],
)
def test_a_bad_override_is_one_line_naming_it(tmp: Path, args: list[str], says: str) -> None:
    for command in ("validate", "plan", "up"):
        result = distlaunch(command, str(_yaml(tmp, GOOD_YAML)), *args, cwd=tmp)
        assert result.returncode == 2, result.stdout + result.stderr
        assert says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp / "runs").exists()  # nothing started


# ---- host files, per_host, --hosts/--exclude ---------------------------------------------------


def _hostfile_spec(tmp: Path, hostfile: str, tasks: str) -> Path:
    (tmp / "hosts.txt").write_text(hostfile)
    return _yaml(
        tmp,
        f"""\
name: t
strategy: multi_worker_mirrored
program: {{script: task.py}}
hostfile: hosts.txt
host_template: {{user: alice, python: /opt/venv/bin/python}}
tasks:
{tasks}
shared_dir: runs
""",
    )


def _placements(plan_text: str) -> list[str]:
    return re.findall(r"^(\S+) on \S+ \(SSH host (\S+)\)$", plan_text, re.M)


def test_a_host_file_and_per_host_spread_the_tasks_in_the_plan(tmp: Path) -> None:
    spec = _hostfile_spec(
        tmp,
        "# our cluster\nnode1 slots=2\nnode2 slots=2   # comment\n\n10.0.0.3 slots=4\n",
        "  worker: {count: 5, per_host: 2}",
    )
    plan = distlaunch("plan", str(spec), cwd=tmp)
    assert plan.returncode == 0, plan.stderr
    assert _placements(plan.stdout) == [
        ("worker-0", "node1"),
        ("worker-1", "node1"),
        ("worker-2", "node2"),
        ("worker-3", "node2"),
        ("worker-4", "10.0.0.3"),
    ]
    # The host template's python runs the program on every host.
    assert plan.stdout.count("command: /opt/venv/bin/python ") == 5
    excluded = distlaunch(
        "plan", str(spec), "--exclude", "node2", "--set", "tasks.worker.count=4", cwd=tmp
    )
    assert _placements(excluded.stdout) == [
        ("worker-0", "node1"),
        ("worker-1", "node1"),
        ("worker-2", "10.0.0.3"),
        ("worker-3", "10.0.0.3"),
    ], excluded.stderr
    only = distlaunch(
        "plan", str(spec), "--hosts", "10.0.0.3", "--set", "tasks.worker.count=2", cwd=tmp
    )
    assert _placements(only.stdout) == [("worker-0", "10.0.0.3"), ("worker-1", "10.0.0.3")], (
        only.stderr
    )
    # Without a count, per_host fills every host.
    full = distlaunch("plan", str(spec), "--set", "tasks.worker={per_host: 1}", cwd=tmp)
    assert [host for _, host in _placements(full.stdout)] == ["node1", "node2", "10.0.0.3"], (
        full.stderr
    )


@pytest.mark.quick
@pytest.mark.parametrize(
    ("hostfile", "tasks", "args", "says"),
    [
        (
            "node1\nnode1 slots=2\n",
            "  worker: {per_host: 1}",
            [],
            "hosts.txt:2: $.hostfile: host 'node1' appears twice",
        ),
        (  # the rule of the spec's `hosts` keys: this machine needs no entry
            "node1\nlocalhost slots=2\n",
            "  worker: {per_host: 1}",
            [],
            "hosts.txt:2: $.hostfile: expected a host name (letters, digits, '.', '-', '_'; not "
            "localhost or 127.0.0.1; at most 253 characters), got 'localhost'",
        ),
        (
            "127.0.0.1\n",
            "  worker: {per_host: 1}",
            [],
            "hosts.txt:1: $.hostfile: expected a host name (letters, digits, '.', '-', '_'; not "
            "localhost or 127.0.0.1; at most 253 characters), got '127.0.0.1'",
        ),
        (
            "node1 slot=2\n",
            "  worker: {per_host: 1}",
            [],
            "hosts.txt:1: $.hostfile: expected slots=N",
        ),
        (
            "node1 slots=1\n",
            "  worker: {per_host: 2}",
            [],
            "$.tasks.worker.per_host: host 'node1' has slots=1",
        ),
        (
            "node1\nnode2\n",
            "  worker: {count: 5, per_host: 2}",
            [],
            "$.tasks.worker.count: 5 tasks do not fit on 2 hosts",
        ),
        (
            "node1\n",
            "  worker: {per_host: 1}",
            ["--exclude", "node7"],
            "--exclude node7: no such host",
        ),
        (
            "node1\nnode2\n",
            "  worker: [{host: node1}, {host: node2}]",
            ["--hosts", "node1"],
            "$.tasks.worker[1].host: host 'node2' is left out by --hosts/--exclude",
        ),
    ],
    ids=[
        "duplicate host",
        "localhost",
        "loopback address",
        "bad key",
        "over slots",
        "too many tasks",
        "unknown filter",
        "filtered-out task",
    ],
)
def test_host_file_and_filter_errors_are_one_line(
    tmp: Path, hostfile: str, tasks: str, args: list[str], says: str
) -> None:
    result = distlaunch("plan", str(_hostfile_spec(tmp, hostfile, tasks)), *args, cwd=tmp)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in result.stderr and result.stderr.count("\n") == 1, result.stderr


# ---- forward_env ---------------------------------------------------------------------------------


@pytest.mark.quick
def test_forwarded_env_is_in_every_task_of_the_plan_and_secrets_are_masked(tmp: Path) -> None:
    spec = write_spec(tmp, forward_env=["NCCL_*", "WANDB_*", "HF_*", "DISTLAUNCH_*"])
    (tmp / "task.py").write_text(PRINT_ENV)
    env = {**os.environ, **LAUNCHER_ENV, "DISTLAUNCH_RUN_ID": "not-forwarded"}
    result = distlaunch("plan", str(spec), "--json", cwd=tmp, env=env)
    assert result.returncode == 0, result.stderr
    for task in json.loads(result.stdout)["tasks"]:
        assert task["env"]["NCCL_DEBUG"] == "INFO" and task["env"]["HF_HOME"] == "/hf"
        assert task["env"]["WANDB_API_KEY"] == "***"
        assert "UNRELATED_VAR" not in task["env"]
        assert task["env"]["DISTLAUNCH_RUN_ID"] != "not-forwarded"
    assert "s3cret" not in result.stdout


def _env_lines(text: str) -> list[dict]:
    return [json.loads(line.split("ENV ", 1)[1]) for line in text.splitlines() if "ENV {" in line]


@pytest.mark.quick
def test_forwarded_env_reaches_local_tasks(tmp: Path) -> None:
    spec = write_spec(tmp, forward_env=["NCCL_*", "WANDB_*", "HF_*"], isolation="off")
    (tmp / "task.py").write_text(PRINT_ENV)
    # The launcher passes only what the spec forwards beyond its own environment: run it with
    # a clean environment so that inheritance alone cannot make the test pass.
    clean = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH")}
    result = distlaunch("up", str(spec), "--fresh", cwd=tmp, env={**clean, **LAUNCHER_ENV})
    assert result.returncode == 0, result.stderr
    # Local tasks also inherit the launcher's environment (UNRELATED_VAR too).
    assert _env_lines(result.stdout) == [{**FORWARDED, "UNRELATED_VAR": "no"}] * 2, result.stdout
    record = run_record(only_run_dir(tmp / "runs"))
    assert "s3cret" not in json.dumps(record)


@pytest.mark.integration
def test_a_host_file_run_over_ssh_gets_the_forwarded_env(ssh_lab, tmp: Path) -> None:
    (tmp / "task.py").write_text(PRINT_ENV)
    # The host file names the hosts by address; the template has what every host needs.
    (tmp / "hosts.txt").write_text("".join(f"{h.address} slots=1\n" for h in ssh_lab.hosts))
    template = ssh_lab.host_entry(ssh_lab.hosts[0])
    del template["address"]
    spec = write_spec(
        tmp,
        hostfile="hosts.txt",
        host_template=template,
        tasks={"worker": {"per_host": 1}},
        forward_env=["NCCL_*", "WANDB_*", "HF_*"],
    )
    result = distlaunch("up", str(spec), "--fresh", cwd=tmp, env={**os.environ, **LAUNCHER_ENV})
    assert result.returncode == 0, result.stderr + result.stdout
    got = _env_lines(result.stdout)
    assert len(got) == 2 and all(line == FORWARDED for line in got), result.stdout
    # Each task ran on its own host of the host file.
    assert sorted(re.findall(r"^worker-\d@(\S+) ", result.stdout, re.M)) == sorted(
        h.address for h in ssh_lab.hosts
    )


@pytest.mark.integration
def test_forwarded_env_reaches_a_compose_task(docker_lock, tmp: Path) -> None:
    from test_compose import BASE_IMAGE, TEST_IMAGE, _env

    if (
        shutil.which("docker") is None
        or subprocess.run(["docker", "info"], capture_output=True).returncode
    ):
        pytest.skip("no reachable Docker engine")
    if (
        not subprocess.run(
            ["docker", "image", "inspect", BASE_IMAGE], capture_output=True
        ).returncode
        == 0
    ):
        pytest.skip(f"no {BASE_IMAGE} image (tests/test_compose.py builds it)")
    (tmp / "task.py").write_text(PRINT_ENV)
    spec = write_spec(
        tmp, tasks={"worker": {"count": 1}}, forward_env=["NCCL_*", "WANDB_*", "HF_*"]
    )
    env = {**_env(), **LAUNCHER_ENV}
    # The generated file carries the values; `up` runs them in a real container.
    written = distlaunch("compose", str(spec), "-o", str(tmp / "compose.yml"), cwd=tmp, env=env)
    assert written.returncode == 0, written.stderr
    service = json.loads((tmp / "compose.yml").read_text())["services"]["worker-0"]
    assert (
        service["environment"]["NCCL_DEBUG"] == "INFO"
        and "UNRELATED_VAR" not in service["environment"]
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "distlaunch.launcher",
            "up",
            str(spec),
            "--backend",
            "compose",
            "--fresh",
            "--image",
            TEST_IMAGE,
            "--base-image",
            BASE_IMAGE,
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _env_lines(result.stdout) == [FORWARDED], result.stdout


# ---- the console: TensorFlow's noise -----------------------------------------------------------


@pytest.mark.quick
def test_the_noise_filter_drops_only_the_known_lines() -> None:
    body = (
        b"\n".join(TF_NOISE_LINES[:3] + KEPT_LINES[:1] + TF_NOISE_LINES[3:] + KEPT_LINES[1:])
        + b"\n"
    )
    assert hide_tf_noise(body) == b"\n".join(KEPT_LINES) + b"\n"


@pytest.mark.quick
@pytest.mark.parametrize("quiet", [True, False], ids=["default", "all"])
def test_the_echo_hides_noise_only_when_asked(tmp: Path, quiet: bool) -> None:
    log = tmp / "task.log"
    log.write_bytes(b"\n".join(TF_NOISE_LINES + KEPT_LINES) + b"\nlast")
    out = tmp / "out"
    with open(out, "wb") as stream:
        console = Console(stream, stream, color=False, quiet_tf=quiet)
        follower = LogFollower(str(log), b"w | ", console)
        follower.pump()
        follower.close()
        console.out.close()
    shown = out.read_bytes().splitlines()
    expected = KEPT_LINES if quiet else TF_NOISE_LINES + KEPT_LINES
    assert shown == [b"w | " + line for line in [*expected, b"last"]]


# ---- status --watch and the live line, in a real terminal --------------------------------------


@pytest.mark.quick
def test_the_heartbeat_carries_what_the_progress_views_show(tmp: Path, monkeypatch) -> None:
    from distlaunch.launcher.diagnosis.progress_view import live_line, screen, task_progress
    from distlaunch.launcher.record.state import RunRecord
    from distlaunch.worker import progress

    monkeypatch.setenv("DISTLAUNCH_STATUS_FILE", str(tmp / "status" / "worker-0.json"))
    monkeypatch.setenv("DISTLAUNCH_ATTEMPT", "1")
    beat = progress.Heartbeat(total_steps=100)
    beat.beat(10, force=True)
    beat.update(loss=0.25, checkpoint_step=10)
    time.sleep(0.05)  # the rate needs two beats apart in time; no assertion is about its value
    beat.beat(30, force=True)
    status = json.loads((tmp / "status" / "worker-0.json").read_text())
    assert {
        k: status[k] for k in ("state", "step", "total_steps", "loss", "checkpoint_step", "attempt")
    } == {
        "state": "ready",
        "step": 30,
        "total_steps": 100,
        "loss": 0.25,
        "checkpoint_step": 10,
        "attempt": 1,
    }
    assert status["steps_per_s"] > 0
    record = RunRecord.from_json(
        {
            "run_id": "r",
            "state": "running",
            "attempt": 1,
            "tasks": {
                "worker-0": {
                    "role": "worker",
                    "index": 0,
                    "port": 1,
                    "state": "running",
                    "attempt": 1,
                },
                "worker-1": {
                    "role": "worker",
                    "index": 1,
                    "port": 2,
                    "state": "starting",
                    "attempt": 1,
                },
            },
        }
    )
    rows = task_progress(tmp, record)
    assert rows[0].step == 30 and rows[0].eta_s is not None and rows[1].step is None
    frame = "\n".join(screen(record, "running", tmp, rows))
    assert re.search(r"worker-0\s+running\s+1\s+30/100\s+[\d.]+\s+0\.25\s+10\s", frame), frame
    assert live_line(rows).startswith("distlaunch: step 30/100 (30%), loss 0.25, ")
    # A heartbeat left by an earlier attempt is not this attempt's progress.
    record.tasks["worker-0"].attempt = 2
    assert task_progress(tmp, record)[0].step is None


def _pane(target: str) -> str:
    return subprocess.run(
        ["tmux", "capture-pane", "-p", "-t", target], capture_output=True, text=True
    ).stdout


# A stand-in for a training program (the views read its heartbeat, whatever trains: a TensorFlow
# start would cost seconds and show nothing more): it serves on its task port as a server would,
# then beats a step every 20 ms of 5000, as dw.fit's heartbeat does.
BEATS = (
    "from distlaunch.worker import progress\n"
    + standins.listening(standins.ANY)
    + """
beat = progress.Heartbeat(total_steps=5000)
for step in range(1, 5001):
    time.sleep(0.02)
    beat.update(loss=1.0 / step)
    beat.beat(step)
"""
)


@pytest.mark.integration
def test_status_watch_and_the_live_line_show_steps_advancing(tmp: Path) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (CI: apt-get install tmux)")
    session = f"dl-watch-{os.getpid()}"
    cli = f"{sys.executable} -m distlaunch.launcher"
    # Enough steps to be seen mid-run; the run is stopped as soon as both views were checked.
    (tmp / "task.py").write_text(BEATS)
    spec = write_spec(tmp, timeouts={"grace_s": 1, "startup_s": 120})
    up = f"{cli} up {spec} --fresh"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "30", "-c", str(tmp)],
        check=True,
    )
    try:
        subprocess.run(["tmux", "send-keys", "-t", f"{session}:0", up, "Enter"], check=True)
        run_dir = wait_for(
            lambda: next((tmp / "runs").glob("*/run.json"), None), "a run dir"
        ).parent
        subprocess.run(["tmux", "new-window", "-t", session, "-c", str(tmp)], check=True)
        subprocess.run(
            ["tmux", "send-keys", "-t", f"{session}:1", f"{cli} status --watch {run_dir}", "Enter"],
            check=True,
        )

        def steps() -> list[int]:
            return [
                int(s)
                for s in re.findall(
                    r"^\s+worker-0\s+running\s+\d+\s+(\d+)/5000 ", _pane(f"{session}:1"), re.M
                )
            ]

        first = wait_for(lambda: steps() or None, "a step on the status --watch screen")[0]
        later = wait_for(
            lambda: [s for s in steps() if s > first] or None, "a later step on the screen"
        )[0]
        assert later > first
        live = wait_for(
            lambda: re.search(
                r"^distlaunch: step (\d+)/5000 \(\d+%\).*ETA", _pane(f"{session}:0"), re.M
            ),
            "the live line of up",
        )
        assert int(live.group(1)) > 0
        # Exactly one live line, below the output.
        assert _pane(f"{session}:0").count("distlaunch: step ") == 1
    finally:
        subprocess.run(["tmux", "send-keys", "-t", f"{session}:0", "C-c"], check=False)
        record = tmp / "runs"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
            json.loads(p.read_text()).get("state") in ("running", "stopping")
            for p in record.glob("*/run.json")
        ):
            time.sleep(0.5)
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
