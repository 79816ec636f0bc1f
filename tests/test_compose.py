"""The compose backend: the generated file (no engine needed), then real runs on a Docker engine.

The engine tests need `docker` with a reachable engine (the session fixture starts `dockerd` when
it is installed but not running, and stops it again), docker-compose v1 or v2, and, the first time
on a machine, `debootstrap` to build a base image (no registry is reachable here). Whatever is
missing skips them, with the reason. Both images stay cached between runs: the base under a fixed
tag, the project image under a tag whose label says which sources it holds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import standins

from conftest import REPO, events, only_run_dir, run_record, write_spec
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec.model import load_spec
from distlaunch.launcher.transports.compose import file as compose
from distlaunch.launcher.transports.compose.docker import DockerError, compose_command, docker, run
from distlaunch.launcher.transports.compose.image import ImageRequest, ensure_image, pip_ca_bundle

BASE_IMAGE = "distlaunch-test-base:bookworm"
# The tests' own tag: a user's distlaunch:local (built on another base) is left alone.
TEST_IMAGE = "distlaunch-test:local"
PROJECT_LABEL = "com.docker.compose.project"
# A cold machine builds the base rootfs and the TensorFlow layer (about 5 minutes) inside the
# setup of the first test that needs the image, which counts against that test's timeout.
pytestmark = pytest.mark.timeout(1200)
MNIST = {
    "module": "distlaunch.worker.examples.mnist_mlp",
    "args": ["--epochs", "1", "--steps-per-epoch", "5"],
}

# A stand-in task (no TensorFlow: what these tests check is the launcher's and the engine's, and
# a TensorFlow start in each container costs seconds): it listens on its TF_CONFIG port in its
# container as a server would (the launcher sees it join) and, as TensorFlow's handler does,
# swallows SIGTERM (a stop kills it after grace_s), then waits; a task restarted in a later
# attempt joins and ends. A peer's death would reach a real worker only through TF's
# coordination heartbeat (10 s) at the earliest, so a waiting peer is what a real one shows.
JOIN_AND_WAIT = (
    standins.SWALLOW_SIGTERM
    + standins.listening(standins.ANY)
    + """
attempt = os.environ["DISTLAUNCH_ATTEMPT"]
print(f"joined in attempt {attempt}", flush=True)
if attempt == "0" or sys.argv[1:] != ["--once"]:
    time.sleep(3600)
"""
)


# ---- the generated file: pure, no engine ---------------------------------------------------


@pytest.mark.quick
def test_each_task_is_a_service_on_an_internal_network_with_no_published_port(tmp):
    spec = write_spec(
        tmp,
        program={"script": "task.py", "args": ["--out", "$HOME/x"], "env": {"GREETING": "a $b"}},
    )
    (tmp / "task.py").write_text("")
    loaded = load_spec(spec)
    plan = compose.compose_plan(loaded, "t-1", tmp / "runs" / "t-1")
    data = compose.compose_file(loaded, plan, "img:tag", "1000:1000")

    assert data["networks"] == {"cluster": {"internal": True}}
    assert set(data["services"]) == {"worker-0", "worker-1"}
    for name, service in data["services"].items():
        assert "ports" not in service and "expose" not in service
        assert service["networks"] == ["cluster"]
        assert service["restart"] == "no"
        # Exec form, the image's python, and $ kept literal (compose would substitute $HOME).
        assert service["command"] == [
            "python",
            "-m",
            "distlaunch.host.bootstrap",
            str(tmp / "task.py"),
            "--out",
            "$$HOME/x",
        ]
        assert service["environment"]["GREETING"] == "a $$b"
        tf_config = json.loads(service["environment"]["TF_CONFIG"])
        assert tf_config["cluster"] == {"worker": ["worker-0:2222", "worker-1:2222"]}
        assert tf_config["task"] == {"type": "worker", "index": int(name[-1])}
        # The shared dir at its own path, writable; the spec's folder (holding it) read-only.
        assert service["volumes"] == [
            {
                "type": "bind",
                "source": str(tmp / "runs"),
                "target": str(tmp / "runs"),
                "read_only": False,
            },
            {"type": "bind", "source": str(tmp), "target": str(tmp), "read_only": True},
        ]
        assert service["user"] == "1000:1000"
        # "permissions" is private by default: the entrypoint sets the umask, then execs the
        # command it gets as its arguments (data, no shell in between).
        assert (
            service["entrypoint"][:2] == ["python", "-c"]
            and "os.umask(0o077)" in service["entrypoint"][2]
        )

    shared = load_spec(write_spec(tmp, program={"script": "task.py"}, permissions="shared"))
    data = compose.compose_file(
        shared, compose.compose_plan(shared, "t-1", tmp / "runs" / "t-1"), "img:tag", "1000:1000"
    )
    assert all("entrypoint" not in service for service in data["services"].values())


@pytest.mark.quick
def test_ps_workers_restart_alone_where_the_spec_allows_it(tmp):
    spec = write_spec(
        tmp,
        strategy="parameter_server",
        program=MNIST,
        tasks={"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 1}},
        restart={"policy": "on-failure", "max_restarts": 4},
    )
    loaded = load_spec(spec)
    data = compose.compose_file(
        loaded, compose.compose_plan(loaded, "t-1", tmp / "runs" / "t-1"), "img", "0:0"
    )
    restarts = {name: service["restart"] for name, service in data["services"].items()}
    assert restarts == {
        "chief-0": "no",
        "worker-0": "on-failure:4",
        "worker-1": "on-failure:4",
        "ps-0": "no",
    }


@pytest.mark.quick
def test_gpus_and_ssh_hosts_are_refused_with_their_json_path(tmp):
    loaded = load_spec(write_spec(tmp, program=MNIST, tasks={"worker": {"count": 2, "gpus": 1}}))
    with pytest.raises(SpecError) as err:
        compose.compose_plan(loaded, "t-1", tmp / "runs" / "t-1")
    assert err.value.json_path == "$.tasks.worker.gpus"
    loaded = load_spec(
        write_spec(
            tmp,
            program=MNIST,
            hosts={"far": {"address": "10.0.0.9"}},
            tasks={"worker": {"count": 2, "host": "far"}},
        )
    )
    with pytest.raises(SpecError) as err:
        compose.compose_plan(loaded, "t-1", tmp / "runs" / "t-1")
    assert err.value.json_path == "$.tasks.worker.host"


@pytest.mark.quick
def test_compose_command_writes_an_owner_only_file_and_the_run_dir(tmp):
    spec = write_spec(tmp, program=MNIST)
    out = tmp / "docker-compose.yml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "distlaunch.launcher",
            "compose",
            str(spec),
            "-o",
            str(out),
            "--run-id",
            "r1",
            "--image",
            "img:1",
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    # The environment in it may carry the program's secrets.
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert {service["image"] for service in json.loads(out.read_text())["services"].values()} == {
        "img:1"
    }
    # Bind mounts need their source: the run dir is there for the containers to write into.
    assert (tmp / "runs" / "r1" / "checkpoints").is_dir()
    assert f"-p r1 -f {out} up" in result.stderr


# ---- a real engine ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """A reachable Docker engine and a compose command; dockerd is started (and later stopped) here
    only when it is installed but not running."""
    started = None
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (CI: apt-get install -y docker.io docker-compose debootstrap)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        started = _start_dockerd(tmp_path_factory.mktemp("dockerd"))
    try:
        compose_command()
    except DockerError as exc:
        _stop(started)
        pytest.skip(str(exc))
    yield
    _stop(started)


def _start_dockerd(folder: Path) -> subprocess.Popen:
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip(
            "the Docker engine is not running, and dockerd is not installed or we are not root to start it"
        )
    log = folder / "dockerd.log"
    # Docker's own defaults, as users run it: its iptables rules are what lets containers on one
    # compose network reach each other where forwarded bridge traffic is filtered (FORWARD policy
    # DROP with br_netfilter, left by any earlier dockerd); with --iptables=false the workers hung
    # there. The SSH and Slurm test labs keep their bridges in namespaces of their own, out of
    # reach of those rules.
    with open(log, "w") as out:
        daemon = subprocess.Popen(
            ["dockerd"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    for _ in range(120):
        if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
            return daemon
        if daemon.poll() is not None:
            break
        time.sleep(0.5)
    _stop(daemon)
    pytest.skip(f"dockerd did not come up:\n{log.read_text()[-2000:]}")


def _stop(daemon: subprocess.Popen | None) -> None:
    if daemon is not None:
        daemon.terminate()
        daemon.wait(timeout=60)


@pytest.fixture(scope="session")
def image(engine, tmp_path_factory):
    """The project image, built on a local Debian base; both reused while unchanged."""
    folder = tmp_path_factory.mktemp("image")
    # `docker image inspect` prints "[]" for a missing image: ask for the id, empty when missing.
    if not docker("image", "inspect", "--format", "{{.Id}}", BASE_IMAGE, check=False).strip():
        _build_base(folder / "rootfs")
    started = time.monotonic()
    built = ensure_image(
        ImageRequest(TEST_IMAGE, BASE_IMAGE), folder / "build.log", pip_ca_bundle()
    )
    print(
        f"image {TEST_IMAGE}: {'built' if built.built else 'reused'} in {time.monotonic() - started:.1f} s"
    )
    return built


def _build_base(rootfs: Path) -> None:
    """A minimal Debian bookworm with python3 and venv, imported as BASE_IMAGE (about 80 s)."""
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip(
            f"no {BASE_IMAGE} image, and debootstrap is not installed or we are not root to build it"
        )
    done = subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            "bookworm",
            str(rootfs),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        ["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, capture_output=True, text=True
    )
    tar.stdout.close()
    assert tar.wait() == 0 and imported.returncode == 0, imported.stderr
    shutil.rmtree(rootfs)


@pytest.mark.integration
@pytest.mark.parametrize(
    "spec", sorted((REPO / "cluster_specs").glob("*.json")), ids=lambda p: p.name
)
def test_every_example_spec_makes_a_valid_compose_file(engine, tmp, spec):
    loaded = load_spec(spec)
    if any(
        loaded.ssh_host(e.host) for entries in loaded.spec.tasks.by_role().values() for e in entries
    ):
        with pytest.raises(SpecError, match="compose backend"):
            compose.compose_plan(loaded, "t-1", tmp / "t-1")
        return
    data = compose.compose_file(
        loaded, compose.compose_plan(loaded, "t-1", tmp / "t-1"), TEST_IMAGE, "0:0"
    )
    file = tmp / "docker-compose.yml"
    file.write_text(json.dumps(data))
    resolved = run([*compose_command(), "--project-name", "t-1", "--file", str(file), "config"])
    assert "ports:" not in resolved and "expose:" not in resolved
    assert re.search(r"^\s+internal: true$", resolved, re.M)


@pytest.mark.integration
def test_two_mwms_workers_train_in_containers(image, tmp):
    spec = write_spec(tmp, program=MNIST)
    result = _up(tmp, spec)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp / "runs")
    record = run_record(run_dir)
    assert record["state"] == "succeeded"
    assert record["plan"]["tasks"][0]["tf_config"]["cluster"] == {
        "worker": ["worker-0:2222", "worker-1:2222"]
    }
    # Logs and checkpoints land on the host, in the run dir, at the paths run.json names.
    losses = [
        re.findall(
            r"final loss (\S+)", (run_dir / "logs" / "attempt-0" / f"worker-{i}.log").read_text()
        )
        for i in (0, 1)
    ]
    assert losses[0] and losses[0] == losses[1]
    assert (run_dir / "checkpoints" / "checkpoint").is_file()
    # What the containers wrote (checkpoints, status files) is owner-only, like the launcher's files.
    assert {str(p) for p in run_dir.rglob("*") if stat.S_IMODE(p.stat().st_mode) & 0o077} == set()
    assert _leftovers(record["compose"]["project"]) == ([], [])


@pytest.mark.integration
def test_chief_two_workers_and_a_ps_train_in_containers(image, tmp):
    spec = write_spec(
        tmp,
        strategy="parameter_server",
        program=MNIST,
        tasks={"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 1}},
    )
    result = _up(tmp, spec)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp / "runs")
    record = run_record(run_dir)
    assert record["state"] == "succeeded"
    assert re.search(
        r"final loss \S+", (run_dir / "logs" / "attempt-0" / "chief-0.log").read_text()
    )
    assert (run_dir / "checkpoints" / "checkpoint").is_file()
    # The servers never end on their own: the launcher stopped them once the chief was done.
    assert {name: task["state"] for name, task in record["tasks"].items()} == {
        "chief-0": "succeeded",
        "worker-0": "stopped",
        "worker-1": "stopped",
        "ps-0": "stopped",
    }
    assert _leftovers(record["compose"]["project"]) == ([], [])


@pytest.mark.integration
def test_killing_a_worker_container_fails_the_run_and_names_it(image, tmp):
    (tmp / "task.py").write_text(JOIN_AND_WAIT)
    launcher = _start_up(tmp, write_spec(tmp))
    try:
        run_dir = _all_joined(tmp, 2)
        project = run_record(run_dir)["compose"]["project"]
        docker("kill", compose.container_name(project, "worker-1"))
        _, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 1, err[-3000:]
    record = run_record(run_dir)
    assert record["failure"]["task"] == "worker-1"
    assert re.search(r"run \S+ failed: worker-1 exit code 137", err)
    assert _leftovers(project) == ([], [])


@pytest.mark.integration
def test_a_restart_starts_new_containers_with_the_new_attempt(image, tmp):
    (tmp / "task.py").write_text(JOIN_AND_WAIT)
    spec = write_spec(
        tmp,
        program={"script": "task.py", "args": ["--once"]},
        restart={"policy": "on-failure", "max_restarts": 1, "backoff": {"initial_s": 0}},
    )
    launcher = _start_up(tmp, spec)
    try:
        run_dir = _all_joined(tmp, 2)
        project = run_record(run_dir)["compose"]["project"]
        docker("kill", compose.container_name(project, "worker-1"))
        _, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    # MWMS restarts the gang: worker-0's container is killed (the container itself, so its `run`
    # process relays the container's 137, not a signal of its own), replaced too, and both get
    # the new attempt's environment.
    assert launcher.returncode == 0, err[-3000:]
    assert [(e["task"], e["exit"]) for e in events(run_dir) if e["event"] == "killed"] == [
        ("worker-0", "exit code 137")
    ]
    for name in ("worker-0", "worker-1"):
        assert "joined in attempt 1" in (run_dir / "logs" / "attempt-1" / f"{name}.log").read_text()
    assert _leftovers(project) == ([], [])


@pytest.mark.integration
def test_ctrl_c_removes_every_container_and_network(image, tmp):
    (tmp / "task.py").write_text(JOIN_AND_WAIT)
    launcher = _start_up(tmp, write_spec(tmp))
    try:
        run_dir = _all_joined(tmp, 2)
        project = run_record(run_dir)["compose"]["project"]
        # While it runs: nothing published, and the network has no way out.
        containers, networks = _leftovers(project)
        assert len(containers) == 2 and len(networks) == 1
        for container in containers:
            assert docker(
                "inspect", "--format", "{{json .HostConfig.PortBindings}}", container
            ).strip() in ("{}", "null")
        assert (
            docker("network", "inspect", "--format", "{{.Internal}}", networks[0]).strip() == "true"
        )
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, err[-3000:]
    assert run_record(run_dir)["state"] == "interrupted"
    assert _leftovers(project) == ([], [])


# ---- helpers ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "DISTLAUNCH_IMAGE": TEST_IMAGE, "DISTLAUNCH_BASE_IMAGE": BASE_IMAGE}


def _up(tmp: Path, spec: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "distlaunch.launcher",
            "up",
            str(spec),
            "--backend",
            "compose",
            "--fresh",
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )


def _start_up(tmp: Path, spec: Path) -> subprocess.Popen:
    # A session of its own: the SIGINT the test sends reaches the launcher alone.
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distlaunch.launcher",
            "up",
            str(spec),
            "--backend",
            "compose",
            "--fresh",
        ],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )


def _all_joined(tmp: Path, count: int) -> Path:
    """Wait until every task's TensorFlow server listens in its container; return the run dir."""
    deadline = time.monotonic() + 300  # a safety net against a hang, not a timing requirement
    while time.monotonic() < deadline:
        for path in (tmp / "runs").glob("*/run.json") if (tmp / "runs").is_dir() else ():
            tasks = json.loads(path.read_text()).get("tasks", {}).values()
            if len(tasks) == count and all(t.get("state") == "running" for t in tasks):
                return path.parent
        time.sleep(0.2)
    raise AssertionError("the tasks never all joined")


def _leftovers(project: str) -> tuple[list[str], list[str]]:
    """The containers and networks that still carry the compose project's label."""
    label = f"label={PROJECT_LABEL}={project}"
    containers = docker("ps", "--all", "--quiet", "--filter", label).split()
    networks = docker("network", "ls", "--quiet", "--filter", label).split()
    return containers, networks


# Writes what it received, as JSON, into the run dir (mounted from the host at the same path).
ECHO_TO_RUN_DIR = """
import json, os, sys
record = {"argv": sys.argv, "file": __file__, "cwd": os.getcwd(), "env": dict(os.environ)}
with open(os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], "echo.json"), "w", encoding="utf-8") as f:
    json.dump(record, f)
"""


@pytest.mark.integration
def test_every_spec_string_reaches_the_container_unchanged(image, tmp, capsys):
    """The injection suite of test_injection.py, through compose: YAML, compose's `$` interpolation
    and the container runtime sit between the spec and the task here."""
    from test_injection import NAME_PAYLOADS, PATH_PAYLOADS, PAYLOADS, chain

    shared = tmp / "r" / Path(*PATH_PAYLOADS)
    canary = (
        shared / "canary"
    )  # inside the mounted shared dir: a shell in a container would make it
    workdir = chain(tmp / "w")
    script = chain(tmp / "s") / "echo.py"
    script.write_text(ECHO_TO_RUN_DIR)
    env = {f"P{i}": p for i, p in enumerate(PAYLOADS)}
    env.update({f"N{i}_{name}": name for i, name in enumerate(NAME_PAYLOADS)})
    env["DL_CANARY"] = str(canary)
    spec = write_spec(
        tmp,
        tasks={"worker": {"count": 1}},
        shared_dir=str(shared.relative_to(tmp)),
        program={
            "script": str(script.relative_to(tmp)),
            "args": PAYLOADS,
            "env": env,
            "workdir": str(workdir.relative_to(tmp)),
        },
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
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
        env={**_env(), "DL_CANARY": "the launcher's, not the task's"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(shared)
    got = json.loads((run_dir / "echo.json").read_text(encoding="utf-8"))
    assert got["argv"] == [str(script), *PAYLOADS]
    assert got["file"] == str(script)
    assert got["cwd"] == str(workdir.resolve())
    assert {k: got["env"].get(k) for k in env} == env
    assert not canary.exists(), "a payload was run by a shell"
    fields = {
        "program.args": len(PAYLOADS),
        "program.env values": len(PAYLOADS),
        "program.env names": len(NAME_PAYLOADS),
        "program.workdir": len(PATH_PAYLOADS),
        "program.script": len(PATH_PAYLOADS),
        "shared_dir": len(PATH_PAYLOADS),
    }
    with capsys.disabled():
        print(
            f"\ninjection (compose): {len(fields)} fields x up to {len(PAYLOADS)} payloads = {sum(fields.values())} "
            "values passed through the compose file into a container: all arrived unchanged, none ran"
        )
