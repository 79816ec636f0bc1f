"""Parameter-server servers end with the chief where no launcher stops them (Kubernetes Jobs, a
compose file run by hand): exit 0 once the chief succeeded, the failure code once it failed for
good (distlaunch.worker.chief_result). Real TensorFlow servers on localhost ports, the pods of
`distlaunch k8s` on Docker, and `distlaunch compose`'s file under `docker compose up`. All Docker
use holds /tmp/dl-docker.lock."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import portpicker
import pytest

from conftest import distlaunch, write_spec
from distlaunch.launcher.transports.compose.docker import compose_command, docker
from distlaunch.worker import chief_result, contract
from distlaunch.worker.chief_result import EndRule, Result, Verdicts
from test_compose import TEST_IMAGE, engine, image  # noqa: F401  (fixtures: the engine, the image)
from test_k8s import MNIST, _manifests, pods_on_docker  # noqa: F401  (fixtures)

PSS_TASKS = {"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 1}}


@pytest.mark.quick
def test_a_success_ends_the_servers_and_a_failure_only_once_it_is_final() -> None:
    verdicts = Verdicts(EndRule(retries=1, final=(2,)))
    assert verdicts.verdict(Result("a", 1)) is None  # the chief's Job retries it
    assert verdicts.verdict(Result("a", 1)) is None  # the same chief, read again
    assert verdicts.verdict(Result("b", 1)) == 2  # a second failure: the budget is spent
    assert Verdicts(EndRule(3, (2,))).verdict(Result("c", 2)) == 2  # never retried
    assert Verdicts(EndRule(0, ())).verdict(Result("d", 137)) == 1
    assert Verdicts(EndRule(0, ())).verdict(Result("e", 0)) == 0


@pytest.mark.quick
def test_only_the_chiefs_result_line_is_read_as_one() -> None:
    assert Result.parse(Result("x1", 3).line()) == Result("x1", 3)
    assert Result.parse(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00") is None  # a gRPC server's hello
    assert Result.parse(b"") is None


# ---- real servers on localhost ports ------------------------------------------------------------


def _task_env(cluster: dict, role: str, index: int, end: EndRule | None) -> dict[str, str]:
    env = {
        **os.environ,
        contract.TF_CONFIG: json.dumps(
            {"cluster": cluster, "task": {"type": role, "index": index}}
        ),
        contract.ROLE: role,
        contract.INDEX: str(index),
        contract.STRATEGY: contract.PSS,
    }
    if end is not None:
        env[contract.END_WITH_CHIEF] = end.to_env()
    return env


def _run_by_hand(tmp: Path, chief_program: list[str]) -> tuple[int, dict[str, int], str]:
    """A PSS cluster launched by hand (chief, 2 workers, 1 ps), the chief under chief_result and
    the servers with END_WITH_CHIEF: the chief's code, each server's code, the servers' logs."""
    ports = iter(portpicker.pick_unused_port() for _ in range(4))
    cluster = {
        "chief": [f"127.0.0.1:{next(ports)}"],
        "worker": [f"127.0.0.1:{next(ports)}", f"127.0.0.1:{next(ports)}"],
        "ps": [f"127.0.0.1:{next(ports)}"],
    }
    end = EndRule(retries=0, final=(2,))
    servers = {}
    for role, index in (("worker", 0), ("worker", 1), ("ps", 0)):
        log = tmp / f"{role}-{index}.log"
        with open(log, "w") as out:
            servers[f"{role}-{index}"] = subprocess.Popen(
                [sys.executable, "-m", "distlaunch.worker.serve"],
                env=_task_env(cluster, role, index, end),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    try:
        chief = subprocess.run(
            [sys.executable, "-m", chief_result.__name__, "--", *chief_program],
            env=_task_env(cluster, "chief", 0, None),
            capture_output=True,
            text=True,
            timeout=300,
        )
        codes = {name: proc.wait(timeout=120) for name, proc in servers.items()}
    finally:
        for proc in servers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    logs = "".join((tmp / f"{name}.log").read_text() for name in servers)
    assert chief.returncode is not None, chief.stderr
    return chief.returncode, codes, logs


@pytest.mark.integration
def test_servers_launched_by_hand_end_with_0_after_the_chief_trained(tmp: Path) -> None:
    program = [sys.executable, "-m", MNIST["module"], "--epochs", "1", "--steps-per-epoch", "5"]
    chief, servers, logs = _run_by_hand(tmp, program)
    assert chief == 0
    assert servers == {"worker-0": 0, "worker-1": 0, "ps-0": 0}, logs
    assert logs.count("the chief succeeded; this server ends") == 3


@pytest.mark.integration
def test_servers_launched_by_hand_fail_when_the_chief_failed(tmp: Path) -> None:
    chief, servers, logs = _run_by_hand(tmp, [sys.executable, "-c", "raise SystemExit(3)"])
    assert chief == 3  # the chief's own code, unchanged
    # The rule's first never-retried code: Kubernetes' podFailurePolicy fails their Jobs at once.
    assert servers == {"worker-0": 2, "worker-1": 2, "ps-0": 2}, logs
    assert logs.count("the chief failed (exit 3); this server ends") == 3


# ---- Kubernetes pods on Docker ------------------------------------------------------------------


@pytest.mark.integration
def test_pss_pods_all_complete_once_the_chief_succeeded(pods_on_docker, tmp: Path) -> None:  # noqa: F811
    objects, run_id = _manifests(tmp, strategy="parameter_server", tasks=PSS_TASKS)
    pods = pods_on_docker.start(objects, "dl-test")
    codes = {host: pods_on_docker.wait(container) for host, container in pods.items()}
    logs = {host: pods_on_docker.logs(container) for host, container in pods.items()}
    assert codes == dict.fromkeys(pods, 0), {h: logs[h][-2000:] for h in pods}
    servers = [host for host in pods if host != f"{run_id}-chief-0"]
    assert len(servers) == 3
    for host in servers:
        assert "the chief succeeded; this server ends" in logs[host], logs[host][-2000:]


# ---- a compose file run by hand -----------------------------------------------------------------


def _compose_by_hand(tmp: Path, program: dict, *flags: str) -> tuple[int, dict[str, str], str]:
    """`distlaunch compose` of a PSS spec, then `docker compose up FLAGS` of its file until it
    ends: compose's exit code, each service's container status, compose's output."""
    spec = write_spec(tmp, strategy="parameter_server", tasks=PSS_TASKS, program=program)
    project = f"dlends-{secrets.token_hex(3)}"
    file = tmp / "compose.yml"
    made = distlaunch(
        "compose", str(spec), "-o", str(file), "--image", TEST_IMAGE, "--run-id", project, cwd=tmp
    )
    assert made.returncode == 0, made.stderr
    command = [*compose_command(), "-p", project, "-f", str(file)]
    try:
        up = subprocess.run(
            [*command, "up", *flags],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        states = docker(
            "ps",
            "--all",
            "--filter",
            f"label=com.docker.compose.project={project}",
            "--format",
            '{{.Label "com.docker.compose.service"}} {{.Status}}',
        )
    finally:
        subprocess.run([*command, "down", "--volumes", "--timeout", "1"], capture_output=True)
    status = dict(line.split(" ", 1) for line in states.splitlines())
    return up.returncode, status, up.stdout + up.stderr


@pytest.mark.integration
def test_a_compose_file_run_by_hand_ends_with_the_chief(
    docker_lock,
    image,  # noqa: F811
    tmp: Path,
) -> None:
    code, status, output = _compose_by_hand(tmp, MNIST)
    assert code == 0, output[-3000:]
    assert set(status) == {"chief-0", "worker-0", "worker-1", "ps-0"}, output[-3000:]
    for service, state in status.items():
        assert state.startswith("Exited (0)"), (service, state, output[-3000:])


@pytest.mark.integration
def test_compose_up_exits_with_the_chiefs_failure(
    docker_lock,
    image,  # noqa: F811
    tmp: Path,
) -> None:
    (tmp / "fail.py").write_text("raise SystemExit(3)\n")
    code, status, output = _compose_by_hand(
        tmp, {"script": "fail.py"}, "--exit-code-from", "chief-0"
    )
    assert code == 3, output[-3000:]
    assert status["chief-0"].startswith("Exited (3)"), status
