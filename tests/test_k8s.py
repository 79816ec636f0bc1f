"""`distlaunch k8s`: manifests checked against the official Kubernetes schemas, then their pods
run for real on the Docker engine.

No Kubernetes API server can run here. So every generated object is validated against the
OpenAPI schemas of Kubernetes 1.37 (kubernetes-validate, strict: an unknown field fails too),
for each strategy and role mix, with the injection suite's payloads in every string field.
JobSet is a CRD whose schema no PyPI package ships: a JobSet's embedded Job templates are
validated with the Job schema, and its own fields are checked by the tests below.

Then the pods: each Job's pod template becomes `docker run` containers (image, command, env
with Kubernetes' `$(VAR)` expansion, hostname, JOB_COMPLETION_INDEX) on an internal network
whose aliases are the pods' DNS names, the PVC a bind mount, and MWMS and PSS train to the end:
the TF_CONFIG the entrypoint builds inside the pods forms a cluster. All docker use holds
/tmp/dl-docker.lock (other suites build and run the same image tag).
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from conftest import distlaunch, write_spec
from distlaunch.host import k8s_entry
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.export import k8s
from distlaunch.launcher.spec.model import load_spec
from distlaunch.launcher.transports.compose.docker import docker
from distlaunch.worker import contract
from test_compose import TEST_IMAGE, engine, image  # noqa: F401  (fixtures: the engine, the image)
from test_injection import NAME_PAYLOADS, PATH_PAYLOADS, PAYLOADS, chain

K8S_VERSION = "1.37.0"
MNIST = {
    "module": "distlaunch.worker.examples.mnist_mlp",
    "args": ["--epochs", "1", "--steps-per-epoch", "5"],
}
ROLE_MIXES = {
    "mwms-workers": ("multi_worker_mirrored", {"worker": {"count": 2}}),
    "mwms-chief-evaluator": (
        "multi_worker_mirrored",
        {"chief": {"count": 1}, "worker": {"count": 3}, "evaluator": {"count": 1}},
    ),
    "pss": (
        "parameter_server",
        {"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 2}},
    ),
    "pss-gpus-evaluator": (
        "parameter_server",
        {
            "chief": {"count": 1, "gpus": 1},
            "worker": [{"gpus": [0, 1]}, {"gpus": [2, 3]}],
            "ps": {"count": 1},
            "evaluator": {"count": 1},
        },
    ),
}
# Env names Kubernetes takes (printable ASCII but "="); the others are refused, see below.
K8S_NAMES = [n for n in NAME_PAYLOADS if all(32 <= ord(c) <= 126 for c in n)]


def expand(value: str, env: dict[str, str]) -> str:
    """What Kubernetes makes of a command item or env value: `$(VAR)` becomes VAR's value when
    VAR is defined, `$$` one `$`, anything else stays (k8s.io/kubernetes third_party expansion)."""
    out, i = [], 0
    while i < len(value):
        if value[i] == "$" and i + 1 < len(value):
            nxt = value[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = value.find(")", i + 2)
                if end != -1 and value[i + 2 : end] in env:
                    out.append(env[value[i + 2 : end]])
                    i = end + 1
                    continue
        out.append(value[i])
        i += 1
    return "".join(out)


def pod_env(container: dict) -> dict[str, str]:
    """A container's plain env values as its process sees them (in order, as Kubernetes expands)."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
    return env


def job_templates(obj: dict) -> list[tuple[str, dict]]:
    """(Job name, Job spec) of every Job an object makes: itself, or a JobSet's replicated Jobs."""
    if obj["kind"] == "Job":
        return [(obj["metadata"]["name"], obj["spec"])]
    if obj["kind"] == "JobSet":
        return [
            (f"{obj['metadata']['name']}-{rj['name']}-0", rj["template"]["spec"])
            for rj in obj["spec"]["replicatedJobs"]
        ]
    return []


def validate(obj: dict) -> None:
    """Validate against the Kubernetes schemas (strict); a JobSet through its Job templates."""
    if obj["kind"] != "JobSet":
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return
    for rj in obj["spec"]["replicatedJobs"]:
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": rj["name"], **rj["template"]["metadata"]},
            "spec": rj["template"]["spec"],
        }
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


# ---- the manifests: pure, no engine -----------------------------------------------------------


def _payload_spec(tmp: Path, strategy: str, tasks: dict, restart: str) -> Path:
    """A spec with the injection payloads in every free string field that reaches a manifest."""
    workdir = chain(tmp / "w")
    script = chain(tmp / "s") / "task.py"
    # A program that serves by itself (distlaunch.worker does): every role runs it, PSS included.
    script.write_text("import distlaunch.worker\n")
    env = {f"P{i}": p for i, p in enumerate(PAYLOADS)}
    env.update({f"N{i} {name}": name for i, name in enumerate(K8S_NAMES)})
    return write_spec(
        tmp,
        strategy=strategy,
        tasks=tasks,
        program={
            "script": str(script.relative_to(tmp)),
            "args": PAYLOADS,
            "env": env,
            "workdir": str(workdir.relative_to(tmp)),
        },
        shared_dir=str(Path("r", *PATH_PAYLOADS)),
        restart={
            "policy": restart,
            "max_restarts": 4,
            "non_retryable_exit_codes": [0, 2, 3, 300],
        },
        timeouts={"run_s": 99.5, "grace_s": 2.5},
        kubernetes={
            "namespace": "team-a",
            "image": "registry.example/ml/distlaunch:1.0",
            "pvc": "shared.runs",
            "cpu": "1500m",
            "memory": "2Gi",
        },
    )


@pytest.mark.quick
@pytest.mark.parametrize("restart", ["never", "on-failure"])
@pytest.mark.parametrize("jobset", [False, True], ids=["jobs", "jobset"])
@pytest.mark.parametrize("mix", ROLE_MIXES)
def test_every_manifest_validates_and_carries_every_payload_unchanged(tmp, mix, jobset, restart):
    strategy, tasks = ROLE_MIXES[mix]
    loaded = load_spec(_payload_spec(tmp, strategy, tasks, restart))
    made = k8s.manifests(
        loaded,
        "inj.case-1_X-20261123-000000-ab12",
        loaded.spec.kubernetes.image,
        "team-a",
        jobset,
    )
    # What kubectl reads is the YAML: it must give back exactly these objects.
    assert list(yaml.safe_load_all(k8s.to_yaml(made.objects))) == list(made.objects)
    for obj in made.objects:
        validate(obj)
        assert obj["metadata"]["namespace"] == "team-a"
    kinds = [o["kind"] for o in made.objects]
    roles = list(loaded.spec.tasks.by_role())
    assert kinds == (
        ["NetworkPolicy", "JobSet"]
        if jobset
        else ["Service", "NetworkPolicy"] + ["Job"] * len(roles)
    )
    budget = 4 if restart == "on-failure" else 0
    for job_name, job in (t for o in made.objects for t in job_templates(o)):
        role = job["template"]["metadata"]["labels"][k8s.ROLE_LABEL]
        pod = job["template"]["spec"]
        (container,) = pod["containers"]
        env = pod_env(container)
        command = [expand(c, env) for c in container["command"]]
        # With plain Jobs, nothing stops a PSS run's servers: its chief tells them its result
        # (distlaunch.worker.chief_result) and they end with it (tests/test_servers_end.py).
        ends = strategy == "parameter_server" and not jobset
        tells = ["python", "-m", "distlaunch.worker.chief_result", "--"]
        # The pod's SIGTERM: a notice to the program (it imports distlaunch.worker: it saves);
        # PSS servers wait for the chief's save; the evaluator is stopped.
        notice = (
            ["group"]
            if role == "evaluator"
            else ["chief", "--save-s", "30"]
            if strategy == "parameter_server" and role != "chief"
            else ["program"]
        )
        assert (contract.END_WITH_CHIEF in env) == (ends and role in ("ps", "worker"))
        # The entrypoint, then the program exactly as the spec says it (payloads and all).
        assert command == [
            "python",
            "-m",
            "distlaunch.host.k8s_entry",
            "--umask",
            "077",
            "--notice",
            *notice,
            "--",
            *(tells if ends and role == "chief" else []),
            "python",
            "-m",
            "distlaunch.host.bootstrap",
            str(loaded.script),
            *PAYLOADS,
        ]
        assert container["workingDir"] == str(loaded.workdir)
        assert {k: env[k] for k in loaded.spec.program.env} == dict(loaded.spec.program.env)
        assert job["completionMode"] == "Indexed" and job["completions"] == job[
            "parallelism"
        ] == len(loaded.spec.tasks.by_role()[role])
        assert pod["restartPolicy"] == "Never" and pod["subdomain"] == made.name
        assert container["image"] == "registry.example/ml/distlaunch:1.0"
        assert container["resources"]["requests"] == {"cpu": "1500m", "memory": "2Gi"}
        assert pod["volumes"] == [
            {"name": "shared", "persistentVolumeClaim": {"claimName": "shared.runs"}}
        ]
        # The grace: timeouts.save_s (30 by default) for the save, then grace_s.
        assert job["activeDeadlineSeconds"] == 100 and pod["terminationGracePeriodSeconds"] == 33
        # The role's cluster names every training pod at its stable DNS name.
        cluster = json.loads(env[contract.CLUSTER])
        sep = "-0-" if jobset else "-"
        if role != "evaluator":
            for r, addrs in cluster.items():
                assert addrs == [
                    f"{made.name}-{r}{sep}{i}.{made.name}:2222" for i in range(len(addrs))
                ]
            assert "evaluator" not in cluster
        else:
            assert cluster == {"evaluator": [f"{made.name}-evaluator{sep}0.{made.name}:2222"]}
        assert job_name + "-0" == f"{made.name}-{role}{sep}0"
        assert len(job_name + "-9999") <= 63
        # Saved on a notice: replaced, not counted; exit codes Kubernetes can match (1-255):
        # never retried; evictions not counted.
        rules = job["podFailurePolicy"]["rules"]
        assert rules == [
            {
                "action": "Ignore",
                "onExitCodes": {"containerName": "task", "operator": "In", "values": [75]},
            },
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": "task", "operator": "In", "values": [2, 3]},
            },
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
        ]
        alone = role == "evaluator" or (strategy == "parameter_server" and role == "worker")
        assert job["backoffLimit"] == (budget if alone or not jobset else 0)
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert (
            gpus == {"chief": 1, "worker": 2}.get(role)
            if mix == "pss-gpus-evaluator"
            else gpus is None
        )
        if gpus:
            assert "CUDA_VISIBLE_DEVICES" not in env
    if jobset:
        spec = made.objects[1]["spec"]
        assert spec["failurePolicy"]["maxRestarts"] == budget
        decides = (
            ["chief"] if strategy == "parameter_server" else [r for r in roles if r != "evaluator"]
        )
        assert spec["successPolicy"] == {
            "operator": "All",
            "targetReplicatedJobs": decides,
        }
        assert spec["network"]["subdomain"] == made.name
        env = made.objects[1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"
        ][0]["env"]
        assert {
            "name": "DISTLAUNCH_ATTEMPT",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}
            },
        } in env


def pod_failure_action(job: dict, code: int, disrupted: bool = False) -> str:
    """What a Job's podFailurePolicy does with a pod whose container exited ``code`` (with the
    DisruptionTarget condition when ``disrupted``): the first matching rule's action, else
    "Count" (the pod counts against backoffLimit), as the Job controller decides."""
    for rule in job["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is not None and code in codes["values"]:
            return rule["action"]
        if disrupted and {"type": "DisruptionTarget", "status": "True"} in rule.get(
            "onPodConditions", []
        ):
            return rule["action"]
    return "Count"


@pytest.mark.quick
@pytest.mark.parametrize("jobset", [False, True], ids=["jobs", "jobset"])
def test_the_pod_failure_rules_come_from_the_exit_code_table(tmp, monkeypatch, jobset):
    """Every Job (a JobSet's too) replaces a pod that exited with a "preempted" code of
    contract.EXIT_CODES without counting it, fails on a fatal one, counts any other; change the
    table and the manifests change with it."""
    loaded = load_spec(write_spec(tmp, program=MNIST, restart={"policy": "on-failure"}))

    def jobs() -> list[dict]:
        made = k8s.manifests(loaded, "t-1", "img", None, jobset)
        found = [job for obj in made.objects for _, job in job_templates(obj)]
        for obj in made.objects:
            validate(obj)
        return found

    for job in jobs():
        assert pod_failure_action(job, contract.EXIT_PREEMPTED) == "Ignore"
        assert pod_failure_action(job, contract.EXIT_FATAL) == "FailJob"
        # 42 and 143 mean "preempted" only after a notice: the pod's entrypoint then exits 75.
        for code in (1, contract.TF_HANDLER_EXIT, contract.SIGTERM_EXIT, 137):
            assert pod_failure_action(job, code) == "Count", code
        assert pod_failure_action(job, 137, disrupted=True) == "Ignore"
    table = tuple(
        ("76", meaning, why) if code == str(contract.EXIT_PREEMPTED) else (code, meaning, why)
        for code, meaning, why in contract.EXIT_CODES
    ) + (("99", contract.ExitMeaning.PREEMPTED, "a test's"),)
    monkeypatch.setattr(contract, "EXIT_CODES", table)
    for job in jobs():
        assert [pod_failure_action(job, c) for c in (75, 76, 99)] == ["Count", "Ignore", "Ignore"]


@pytest.mark.quick
def test_the_network_policy_admits_the_task_port_from_the_runs_own_pods_only(tmp):
    loaded = load_spec(write_spec(tmp, program=MNIST))
    made = k8s.manifests(loaded, "t-1", "img", None, False)
    service, policy = made.objects[:2]
    pods = {"matchLabels": {"distlaunch.io/run": "t-1"}}
    assert policy["spec"] == {
        "podSelector": pods,
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [{"podSelector": pods}],
                "ports": [{"protocol": "TCP", "port": 2222}],
            }
        ],
    }
    assert (
        service["spec"]["clusterIP"] == "None"
        and service["spec"]["selector"] == pods["matchLabels"]
    )
    assert "namespace" not in service["metadata"]
    # No PVC in the spec: an emptyDir, and the user is told what that costs.
    job = made.objects[2]["spec"]["template"]["spec"]
    assert job["volumes"] == [{"name": "shared", "emptyDir": {}}]
    assert any("emptyDir" in note for note in made.notes)


@pytest.mark.quick
def test_the_validator_catches_a_wrong_manifest(tmp):
    """The schema check is not a rubber stamp: a misspelt field and a wrong type fail it."""
    loaded = load_spec(write_spec(tmp, program=MNIST))
    job = k8s.manifests(loaded, "t-1", "img", None, False).objects[2]
    validate(job)
    for broken in (
        {**job, "spec": {**job["spec"], "completion": 2}},
        {**job, "spec": {**job["spec"], "completions": "2"}},
    ):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken)


@pytest.mark.quick
def test_long_and_odd_run_ids_make_valid_names():
    for run_id in (
        "9lives_X.Y-20261123-101010-abcd",
        "a" * 64 + "-20261123-101010-abcd",
        "t",
    ):
        name = k8s.object_name(run_id)
        assert re.fullmatch(r"[a-z]([a-z0-9-]*[a-z0-9])?", name) and len(name) <= k8s.MAX_NAME, name
    assert k8s.object_name("a" * 64 + "-20261123-101010-abcd").endswith("20261123-101010-abcd")


@pytest.mark.quick
@pytest.mark.parametrize(
    ("what", "fields", "path"),
    [
        (
            "ssh host",
            {
                "hosts": {"far": {"address": "10.0.0.9"}},
                "tasks": {"worker": {"count": 2, "host": "far"}},
            },
            "$.tasks.worker.host",
        ),
        (
            "gpus differ",
            {"tasks": {"worker": [{"gpus": 1}, {"gpus": 2}]}},
            "$.tasks.worker[0].gpus",
        ),
        ("env name", {"program": {**MNIST, "env": {"ünï": "x"}}}, "$.program.env.ünï"),
    ],
)
def test_what_pods_cannot_run_is_a_spec_error(tmp, what, fields, path):
    loaded = load_spec(write_spec(tmp, **{"program": MNIST, **fields}))
    with pytest.raises(SpecError) as err:
        k8s.manifests(loaded, "t-1", "img", None, False)
    assert err.value.json_path == path, what


@pytest.mark.quick
@pytest.mark.parametrize("key", ["namespace", "image", "pvc", "cpu"])
def test_payloads_in_kubernetes_names_are_refused_with_their_json_path(tmp, key):
    for payload in PAYLOADS:
        spec = write_spec(tmp, program=MNIST, kubernetes={key: payload})
        with pytest.raises(SpecError) as err:
            load_spec(spec)
        assert err.value.json_path == f"$.kubernetes.{key}", payload


@pytest.mark.quick
def test_the_command_writes_a_private_file_and_bad_flags_exit_2(tmp):
    spec = write_spec(
        tmp,
        strategy="parameter_server",
        program=MNIST,
        tasks={"chief": {"count": 1}, "worker": {"count": 1}, "ps": {"count": 1}},
    )
    out = tmp / "k8s.yaml"
    done = distlaunch(
        "k8s",
        str(spec),
        "-o",
        str(out),
        "--run-id",
        "r1",
        "--namespace",
        "ml",
        "--image",
        "reg/img:2",
        cwd=tmp,
    )
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o077 == 0
    objects = list(yaml.safe_load_all(out.read_text()))
    assert [o["kind"] for o in objects] == [
        "Service",
        "NetworkPolicy",
        "Job",
        "Job",
        "Job",
    ]
    assert {o["metadata"]["namespace"] for o in objects} == {"ml"}
    # PSS: the servers' Jobs end with the chief's; nothing is left for the user to delete.
    assert "kubectl" not in done.stderr
    for flag in (
        ["--namespace", "Bad_NS"],
        ["--image", 'x; touch "$DL_CANARY"'],
        ["--run-id", "../x"],
    ):
        bad = distlaunch("k8s", str(spec), *flag, cwd=tmp)
        assert (
            bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
        ), bad.stderr
    bad = distlaunch(
        "k8s",
        str(write_spec(tmp, program=MNIST, kubernetes={"pvc": "Not A Name"})),
        cwd=tmp,
    )
    assert (
        bad.returncode == 2 and "$.kubernetes.pvc" in bad.stderr and "Traceback" not in bad.stderr
    )


@pytest.mark.quick
def test_the_entrypoint_builds_tf_config_from_the_pod_index():
    cluster = {"chief": ["c-0.s:2222"], "worker": ["w-0.s:2222", "w-1.s:2222"]}
    environ = {
        contract.ROLE: "worker",
        contract.JOB_COMPLETION_INDEX: "1",
        contract.CLUSTER: json.dumps(cluster),
        contract.RUN_DIR: "/runs/r1",
        contract.ATTEMPT: "2",
    }
    env = k8s_entry.task_env(environ)
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": cluster,
        "task": {"type": "worker", "index": 1},
    }
    assert env[contract.INDEX] == "1"
    assert env[contract.ERROR_FILE] == "/runs/r1/errors/attempt-2/worker-1.json"
    assert env[contract.STATUS_FILE] == "/runs/r1/status/worker-1.json"
    for broken in (
        {**environ, contract.JOB_COMPLETION_INDEX: "2"},
        {**environ, contract.CLUSTER: "{"},
        {contract.ROLE: "worker"},
    ):
        with pytest.raises(k8s_entry.EntryError):
            k8s_entry.task_env(broken)


@pytest.mark.quick
def test_the_entrypoint_runs_the_program_and_refuses_a_bad_pod_with_exit_2(tmp):
    environ = {
        contract.ROLE: "worker",
        contract.JOB_COMPLETION_INDEX: "0",
        contract.CLUSTER: '{"worker": ["w-0.s:2222"]}',
        contract.RUN_DIR: str(tmp / "run"),
        "PATH": "/usr/bin:/bin",
    }
    probe = "import os, sys; print(os.environ['TF_CONFIG'], sys.argv[1:])"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "distlaunch.host.k8s_entry",
            "--",
            sys.executable,
            "-c",
            probe,
            "a b",
            "$x",
        ],
        env=environ,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.strip()
        == '{"cluster":{"worker":["w-0.s:2222"]},"task":{"type":"worker","index":0}} '
        + "['a b', '$x']"
    )
    assert (tmp / "run" / "status").is_dir() and (tmp / "run" / "errors" / "attempt-0").is_dir()
    bad = subprocess.run(
        [sys.executable, "-m", "distlaunch.host.k8s_entry", "--", "true"],
        env={**environ, contract.JOB_COMPLETION_INDEX: "5"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (
        bad.returncode == 2 and "no task worker:5" in bad.stderr and "Traceback" not in bad.stderr
    )


# ---- the pods, run on the Docker engine ---------------------------------------------------------


@pytest.fixture
def pods_on_docker(docker_lock, image, tmp):  # noqa: F811  (the fixture)
    """Runs a manifest's Jobs as containers; removes every container and the network afterwards."""
    runner = PodRunner(tmp / "pvc")
    yield runner
    runner.remove()


class PodRunner:
    """Each pod of each Job as a `docker run` container, as the kubelet would start it."""

    def __init__(self, pvc: Path) -> None:
        self.pvc = pvc
        self.pvc.mkdir()
        self.tag = f"dlk8s-{secrets.token_hex(3)}"
        self.containers: list[str] = []
        # internal: like the NetworkPolicy, nothing outside the run reaches (or is reached).
        docker("network", "create", "--internal", self.tag)

    def start(self, objects: list[dict], namespace: str) -> dict[str, str]:
        """Start every pod of every Job; return pod name -> container."""
        started = {}
        for job_name, job in (t for o in objects for t in job_templates(o)):
            pod = job["template"]["spec"]
            (container,) = pod["containers"]
            (volume,) = pod["volumes"]
            assert "persistentVolumeClaim" in volume, "these runs need a PVC: the shared run dir"
            for index in range(job["completions"]):
                host = f"{job_name}-{index}"
                env = {contract.JOB_COMPLETION_INDEX: str(index), **pod_env(container)}
                command = [expand(c, env) for c in container["command"]]
                name = f"{self.tag}-{host}"
                args = [
                    # No --init: the kubelet runs the pod's command as its PID 1.
                    "run",
                    "--detach",
                    "--name",
                    name,
                    "--hostname",
                    host,
                    "--network",
                    self.tag,
                    "--network-alias",
                    f"{host}.{pod['subdomain']}",
                    "--network-alias",
                    f"{host}.{pod['subdomain']}.{namespace}.svc.cluster.local",
                    "--volume",
                    f"{self.pvc}:{container['volumeMounts'][0]['mountPath']}",
                ]
                for key, value in env.items():
                    args += ["--env", f"{key}={value}"]
                self.containers.append(name)
                docker(*args, "--entrypoint", command[0], container["image"], *command[1:])
                started[host] = name
        return started

    def wait(self, container: str) -> int:
        """The container's exit code once it has ended."""
        return int(docker("wait", container).strip())

    def logs(self, container: str) -> str:
        done = subprocess.run(
            ["docker", "logs", container], capture_output=True, text=True, check=False
        )
        return done.stdout + done.stderr

    def remove(self) -> None:
        if self.containers:
            docker("rm", "--force", *self.containers, check=False)
        docker("network", "rm", self.tag, check=False)


def _manifests(tmp: Path, **fields: Any) -> tuple[list[dict], str]:
    """The objects `distlaunch k8s` writes for a spec with ``fields``, and the run id."""
    run_id = f"k8s-{secrets.token_hex(3)}"
    spec = write_spec(tmp, **{"program": MNIST, "kubernetes": {"pvc": "runs"}, **fields})
    out = tmp / "k8s.yaml"
    done = distlaunch(
        "k8s",
        str(spec),
        "-o",
        str(out),
        "--image",
        TEST_IMAGE,
        "--namespace",
        "dl-test",
        "--run-id",
        run_id,
        cwd=tmp,
    )
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(out.read_text()))
    for obj in objects:
        validate(obj)
    return objects, run_id


def _tf_config(log: str) -> dict:
    found = re.search(r"^distlaunch: \S+: TF_CONFIG (\{.*\})$", log, re.MULTILINE)
    assert found, log[-3000:]
    return json.loads(found.group(1))


@pytest.mark.integration
def test_two_mwms_worker_pods_form_a_cluster_and_train(pods_on_docker, tmp, capsys):
    objects, run_id = _manifests(tmp)
    pods = pods_on_docker.start(objects, "dl-test")
    assert list(pods) == [f"{run_id}-worker-0", f"{run_id}-worker-1"]
    codes = {host: pods_on_docker.wait(c) for host, c in pods.items()}
    logs = {host: pods_on_docker.logs(c) for host, c in pods.items()}
    assert codes == dict.fromkeys(pods, 0), logs
    for index, host in enumerate(pods):
        assert _tf_config(logs[host]) == {
            "cluster": {"worker": [f"{h}.{run_id}:2222" for h in pods]},
            "task": {"type": "worker", "index": index},
        }
    losses = [re.findall(r"final loss (\S+)", logs[host]) for host in pods]
    assert losses[0] and losses[0] == losses[1]
    with capsys.disabled():
        print(
            f"\nk8s pods on docker (MWMS): {', '.join(pods)} exited 0, final loss {losses[0][-1]} on both"
        )
    run_dir = pods_on_docker.pvc / run_id
    assert (run_dir / "checkpoints" / "checkpoint").is_file()
    assert {p.name for p in (run_dir / "metrics").iterdir()} == {
        "worker-0.json",
        "worker-1.json",
    }


@pytest.mark.integration
def test_pss_pods_train_and_the_chief_decides(pods_on_docker, tmp, capsys):
    objects, run_id = _manifests(
        tmp,
        strategy="parameter_server",
        tasks={"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 1}},
    )
    pods = pods_on_docker.start(objects, "dl-test")
    chief = pods[f"{run_id}-chief-0"]
    code = pods_on_docker.wait(chief)
    log = pods_on_docker.logs(chief)
    assert code == 0, log[-3000:]
    final = re.findall(r"final loss \S+", log)
    assert final
    assert _tf_config(log)["cluster"] == {
        "chief": [f"{run_id}-chief-0.{run_id}:2222"],
        "worker": [f"{run_id}-worker-{i}.{run_id}:2222" for i in (0, 1)],
        "ps": [f"{run_id}-ps-0.{run_id}:2222"],
    }
    assert (pods_on_docker.pvc / run_id / "checkpoints" / "checkpoint").is_file()
    # How the servers end with it: tests/test_servers_end.py.
    with capsys.disabled():
        print(f"\nk8s pods on docker (PSS): chief exited 0 ({final[-1]})")
