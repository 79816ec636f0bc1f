"""Kubernetes manifests of a spec: core objects (or one JobSet) that run the same plan in pods.

What it decides, per run:
- one headless Service (the run's DNS subdomain) and one Indexed Job per role: a pod's hostname
  is ``<job>-<index>`` and it resolves as ``<job>-<index>.<service>``, so every address in
  TF_CONFIG is known before anything runs. Kubernetes alone knows which index a pod is, so the
  container starts `distlaunch.host.k8s_entry`, which builds TF_CONFIG from
  JOB_COMPLETION_INDEX and the role's cluster (DISTLAUNCH_CLUSTER) and execs the program;
- a NetworkPolicy that admits the task port only from the run's own pods (TensorFlow's gRPC has
  no authentication: the equivalent of the compose backend's internal network);
- restart rules mapped onto what a Job can express: backoffLimit for the budget, a
  podFailurePolicy that replaces a pod that saved on a stop notice without counting it (the
  "preempted" codes of contract.EXIT_CODES), fails the Job on non-retryable exit codes and does
  not count evictions;
- the pod's SIGTERM is a stop notice (`notice_of`, launcher/host/pod_init.py), and
  terminationGracePeriodSeconds leaves timeouts.save_s for the save, then grace_s.
  A Job retries its own pods only: MWMS needs the whole gang restarted, which only a JobSet can
  do (``jobset=True``: ``failurePolicy.maxRestarts`` recreates every Job of the set);
- with plain Jobs, a PSS run's servers end with the chief (nothing else stops them): the chief
  runs under `distlaunch.worker.chief_result`, which tells them its result, and their env says
  when it is final (`end_with_chief`). A JobSet's end stops them instead.

Everything else comes from the plan (`plan.make_plan` with every task in a pod,
`placement.in_containers`): the cluster's addresses, argv, the program's env, the distlaunch
contract. Nothing here touches a cluster or the machine.
Spec strings reach Kubernetes as data: every ``$`` in command and env is doubled, because
Kubernetes expands ``$(VAR)`` there and reads ``$$`` as a literal ``$``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distlaunch.host import k8s_entry
from distlaunch.host.pod_init import Notice
from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.errors import SpecError, UsageError
from distlaunch.launcher.plan import placement
from distlaunch.launcher.plan.cpu_fit import CpuHow
from distlaunch.launcher.plan.placement import IMAGE_PYTHON, Placements
from distlaunch.launcher.plan.plan import TaskPlan, make_plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.spec.model import (
    IMAGE_REF,
    K8S_LABEL,
    LoadedSpec,
    refuse_elastic,
    task_json_path,
)
from distlaunch.worker import chief_result, contract

# Every task's TensorFlow server port: each pod has its own IP, so one port serves all.
PORT = 2222
# Where the shared dir (the spec's PVC) is mounted in every pod; run dirs live under it.
MOUNT = "/distlaunch/runs"
CONTAINER = "task"
RUN_LABEL = "distlaunch.io/run"
ROLE_LABEL = "distlaunch.io/role"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
# JobSet labels every pod with how often the set was restarted: the task's attempt.
JOBSET_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
# A pod's hostname <name>-<role>-<index> (JobSet: <name>-<role>-0-<index>) must fit a DNS
# label (63): this leaves room for "-evaluator-0-" and a four-digit index.
MAX_NAME = 44
# Hex digits of the run id's digest in the name of a run whose id is not a DNS label as it is.
_DIGEST = 8
# Variables the entrypoint sets from the pod's index; the manifest cannot know them.
PER_TASK_ENV = (
    contract.TF_CONFIG,
    contract.INDEX,
    contract.ERROR_FILE,
    contract.STATUS_FILE,
    contract.METRICS_FILE,
)
# What Kubernetes accepts as an env name (printable ASCII but "="; Kubernetes >= 1.34).
_ENV_NAME = re.compile(r"^[ -<>-~]+$")


@dataclass(frozen=True)
class Manifests:
    """The objects to apply, in order, and what the user must know about running them."""

    objects: tuple[dict[str, Any], ...]
    name: str  # the run's object name: Service, label value, prefix of every Job
    run_dir: str  # the run dir inside the pods
    notes: tuple[str, ...]


def object_name(run_id: str) -> str:
    """The run's name in Kubernetes: a DNS label starting with a letter, short enough for hostnames.

    A run id that is such a label already is its own name. Any other is lowercased, with runs of
    other characters made one ``-``, plus a digest of the exact run id: ``exp.1``, ``Exp-1`` and
    ``exp_1`` are three runs (three run dirs) and get three names, so no run's Service, Jobs or
    NetworkPolicy (which admits pods by this name as a label) are another run's. A long run id
    keeps its head and its tail (time and random suffix), which tell runs apart.
    """
    name = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", run_id.lower())).strip("-")
    if name == run_id and name[:1].isalpha() and len(name) <= MAX_NAME:
        return name
    if not name[:1].isalpha():
        name = f"r-{name}".rstrip("-")
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:_DIGEST]
    if len(name) + 1 + _DIGEST <= MAX_NAME:
        return f"{name}-{digest}"
    tail = name[-20:].lstrip("-")
    head = name[: MAX_NAME - _DIGEST - len(tail) - 2].rstrip("-")
    return f"{head}-{digest}-{tail}"


def check_image(image: str) -> str:
    """``image`` when it is an image reference; UsageError otherwise (for --image)."""
    if not re.fullmatch(IMAGE_REF, image) or len(image) > 512:
        raise UsageError(
            f"--image: expected an image reference like registry/name:tag, got {image!r}"
        )
    return image


def check_run_id(run_id: str) -> str:
    """``run_id`` when it can name a run dir under the mount (no "/", no ".."); UsageError otherwise."""
    rundir.check_run_id(run_id)  # the rule every command's --run-id follows
    return run_id


def check_namespace(namespace: str) -> str:
    """``namespace`` when it is a namespace name; UsageError otherwise (for --namespace)."""
    if not re.fullmatch(K8S_LABEL, namespace):
        raise UsageError(
            f"--namespace: expected a DNS label (lowercase letters, digits, '-'), got {namespace!r}"
        )
    return namespace


def manifests(
    loaded: LoadedSpec, run_id: str, image: str, namespace: str | None, jobset: bool
) -> Manifests:
    """The manifests that run ``loaded`` as run ``run_id`` (see the module docstring).

    Raises SpecError for what pods cannot do: tasks on SSH hosts, tasks of one role with
    different GPU counts (one pod template per role), env names Kubernetes refuses, an elastic
    range (nothing in the manifests re-forms TF_CONFIG).
    """
    # Each pod is placed by Kubernetes: no machine is known to split; counts are what pods ask.
    where = placement.with_cpus(loaded, placement.on_hosts(loaded), {})
    _check_fits(loaded, where)
    spec = loaded.spec
    name = object_name(run_id)
    run_dir = f"{MOUNT}/{run_id}"
    # Every pod's hostname resolves under the run's Service: TF_CONFIG's addresses are known now.
    placed = placement.in_containers(
        where,
        PORT,
        TaskTransport.POD,
        address=lambda r, i: f"{_hostname(name, r, i, jobset)}.{name}",
    )
    plan = make_plan(loaded, placed, run_id, Path(run_dir))
    meta = {"namespace": namespace} if namespace else {}
    end = None if jobset else end_with_chief(loaded)
    jobs = {}
    for role, rows in placed.by_role().items():
        # One template per role, from its first task: the entrypoint sets what differs by index.
        first = plan.task(contract.task_name(role, 0))
        cluster = first.tf_config["cluster"]
        saves = plan.program.saves_on_notice
        pod = _pod_template(loaded, first, name, image, cluster, jobset, end, saves)
        jobs[role] = _job_spec(loaded, role, len(rows), pod, jobset)
    labels = {RUN_LABEL: name}
    policy = _network_policy(name, meta)
    if jobset:
        objects = (policy, _jobset(loaded, name, meta, labels, jobs))
    else:
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, **meta, "labels": labels},
            "spec": {
                "clusterIP": "None",
                "selector": labels,
                # Tasks dial each other while they start: no readiness gates their addresses.
                "publishNotReadyAddresses": True,
                "ports": [{"name": "tf", "port": PORT, "targetPort": PORT, "protocol": "TCP"}],
            },
        }
        objects = (
            service,
            policy,
            *(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {
                        "name": f"{name}-{role}",
                        **meta,
                        "labels": {**labels, ROLE_LABEL: role},
                    },
                    "spec": {**job, "ttlSecondsAfterFinished": spec.kubernetes.ttl_s},
                }
                for role, job in jobs.items()
            ),
        )
    return Manifests(objects, name, run_dir, _notes(loaded, jobset))


def to_yaml(objects: tuple[dict[str, Any], ...]) -> str:
    """The objects as one multi-document YAML stream, as `kubectl apply -f` reads it."""
    return yaml.dump_all(
        objects, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1 << 16
    )


class _Dumper(yaml.SafeDumper):
    """Safe YAML with every value written out where it is used (no &anchors, *aliases)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _hostname(name: str, role: str, index: int, jobset: bool) -> str:
    # An Indexed Job names its pods' hosts <job>-<index>; JobSet's Jobs are <set>-<replicatedJob>-<n>.
    return f"{name}-{role}-0-{index}" if jobset else f"{name}-{role}-{index}"


def seconds_text(seconds: float) -> str:
    """Seconds as an argument writes them: every digit (``:g`` writes 1234567 as 1.23457e+06),
    to the millisecond."""
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


def end_with_chief(loaded: LoadedSpec) -> chief_result.EndRule | None:
    """How a PSS run's servers end with the chief in plain Jobs, where nothing else stops them:
    the chief Job's retries and the exit codes it never retries (None for MWMS)."""
    spec = loaded.spec
    if spec.strategy != contract.PSS:
        return None
    retries = spec.restart.max_restarts if spec.restart.policy == "on-failure" else 0
    return chief_result.EndRule(retries, spec.restart.final_exit_codes())


def _pod_template(
    loaded: LoadedSpec,
    task: TaskPlan,
    name: str,
    image: str,
    cluster: dict,
    jobset: bool,
    end: chief_result.EndRule | None,
    saves_on_notice: bool,
) -> dict[str, Any]:
    """The pod of every task of ``task``'s role: the entrypoint, the program, the role's env;
    with ``end``, the chief tells the servers its result and they end with it."""
    spec = loaded.spec
    gpus = len(task.gpus)
    env = [
        {"name": key, "value": _literal(value)}
        for key, value in task.env.items()
        # With GPUs, the device plugin decides which ones the container sees.
        if key not in PER_TASK_ENV
        and not (gpus and key == "CUDA_VISIBLE_DEVICES")
        and not (jobset and key == contract.ATTEMPT)
    ]
    env.append(
        {
            "name": contract.CLUSTER,
            "value": _literal(json.dumps(cluster, separators=(",", ":"))),
        }
    )
    if jobset:
        field = f"metadata.labels['{JOBSET_ATTEMPT_LABEL}']"
        env.append({"name": contract.ATTEMPT, "valueFrom": {"fieldRef": {"fieldPath": field}}})
    tells = end is not None and task.role == contract.CHIEF
    if end is not None and task.role in (contract.PS, contract.WORKER):
        env.append({"name": contract.END_WITH_CHIEF, "value": _literal(end.to_env())})
    umask = ["--umask", f"{rundir.PRIVATE_UMASK:03o}"] if spec.permissions == "private" else []
    notice = notice_of(saves_on_notice, spec.strategy, task.role)
    save = ["--save-s", seconds_text(spec.timeouts.save_s)] if notice == Notice.CHIEF else []
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": [
            IMAGE_PYTHON,
            "-m",
            k8s_entry.__name__,
            *umask,
            "--notice",
            notice.value,
            *save,
            "--",
            *([IMAGE_PYTHON, "-m", chief_result.__name__, "--"] if tells else []),
            *(_literal(a) for a in task.argv),
        ],
        "env": env,
        "ports": [{"name": "tf", "containerPort": PORT, "protocol": "TCP"}],
        "volumeMounts": [{"name": "shared", "mountPath": MOUNT}],
    }
    if spec.program.workdir is not None:
        container["workingDir"] = task.cwd
    resources = _resources(loaded, gpus, task.cpus.count)
    if resources:
        container["resources"] = resources
    k8s = spec.kubernetes
    volume = {"persistentVolumeClaim": {"claimName": k8s.pvc}} if k8s.pvc else {"emptyDir": {}}
    return {
        "metadata": {"labels": {RUN_LABEL: name, ROLE_LABEL: task.role}},
        "spec": {
            "subdomain": name,
            # podFailurePolicy needs it; a failed pod is replaced by the Job, never restarted in place.
            "restartPolicy": "Never",
            # The tasks never talk to the API server: no token in them.
            "automountServiceAccountToken": False,
            # The pod's SIGTERM is a stop notice: the save's deadline, then the teardown's grace.
            "terminationGracePeriodSeconds": math.ceil(
                spec.timeouts.save_s + spec.timeouts.grace_s
            ),
            "containers": [container],
            "volumes": [{"name": "shared", **volume}],
        },
    }


def notice_of(saves_on_notice: bool, strategy: str, role: str) -> Notice:
    """Where a pod of ``role`` sends its SIGTERM (launcher/host/pod_init.py), as `up` sends its stop
    notice: to the program of every training task when the program can save (program_scan's
    ``saves_on_notice``; PSS: the chief's, whose servers wait for its save), else to the whole
    process group (a stop, as before)."""
    if not saves_on_notice or role == contract.EVALUATOR:
        return Notice.GROUP
    if strategy == contract.PSS and role != contract.CHIEF:
        return Notice.CHIEF
    return Notice.PROGRAM


def _resources(loaded: LoadedSpec, gpus: int, cpus: int = 0) -> dict[str, Any]:
    """The container's requests and limits: kubernetes.cpu and .memory, a task's `cpus` count in
    place of kubernetes.cpu (an integer, requested = limit: with its memory likewise the pod is
    Guaranteed, and the kubelet's static CPU manager pins it to CPUs of its own), its GPUs."""
    k8s = loaded.spec.kubernetes
    cpu: int | str | None = cpus if cpus else k8s.cpu
    amounts = {key: value for key, value in (("cpu", cpu), ("memory", k8s.memory)) if value}
    limits = {**amounts, **({"nvidia.com/gpu": gpus} if gpus else {})}
    return {
        **({"requests": amounts} if amounts else {}),
        **({"limits": limits} if limits else {}),
    }


def preempted_exit_codes() -> tuple[int, ...]:
    """The exit codes that contract.EXIT_CODES reads as "preempted" whatever came before (a row
    whose code is a number). Those it reads so only after a notice (42, 143) the pod's
    entrypoint turns into EXIT_PREEMPTED: it knows whether the pod had one, Kubernetes does not."""
    return tuple(
        sorted(
            int(code)
            for code, meaning, _ in contract.EXIT_CODES
            if meaning == contract.ExitMeaning.PREEMPTED and code.isdigit()
        )
    )


def _job_spec(loaded: LoadedSpec, role: str, count: int, pod: dict, jobset: bool) -> dict[str, Any]:
    """An Indexed Job of ``count`` pods with the spec's restart rules as a Job can hold them."""
    spec = loaded.spec
    budget = spec.restart.max_restarts if spec.restart.policy == "on-failure" else 0
    # In a JobSet, a failed Job restarts the whole set (its maxRestarts is the budget): roles
    # whose failure needs the others restarted fail their Job at once; roles that restart alone
    # (a PSS worker, the evaluator) keep retrying inside their Job, as `up` does.
    alone = role == contract.EVALUATOR or (
        spec.strategy == contract.PSS and role == contract.WORKER
    )
    # A pod that saved on its stop notice is replaced without counting a failure (the codes of
    # contract.EXIT_CODES; the entrypoint exits with one of them after a notice, see pod_init).
    rules: list[dict[str, Any]] = [
        {
            "action": "Ignore",
            "onExitCodes": {
                "containerName": CONTAINER,
                "operator": "In",
                "values": list(preempted_exit_codes()),
            },
        }
    ]
    codes = list(loaded.spec.restart.final_exit_codes())
    if codes:
        rules.append(
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER,
                    "operator": "In",
                    "values": codes,
                },
            }
        )
    # A pod evicted or preempted (node drain, OOM of the node) is not the program's failure.
    rules.append(
        {
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        }
    )
    job: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": count,
        "parallelism": count,
        "backoffLimit": budget if alone or not jobset else 0,
        "podFailurePolicy": {"rules": rules},
        "template": pod,
    }
    if spec.timeouts.run_s is not None:
        job["activeDeadlineSeconds"] = math.ceil(spec.timeouts.run_s)
    return job


def _network_policy(name: str, meta: dict[str, str]) -> dict[str, Any]:
    """Ingress to the run's pods: the task port, from the run's own pods; nothing else."""
    pods = {"matchLabels": {RUN_LABEL: name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, **meta, "labels": {RUN_LABEL: name}},
        "spec": {
            "podSelector": pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": pods}],
                    "ports": [{"protocol": "TCP", "port": PORT}],
                }
            ],
        },
    }


def _jobset(
    loaded: LoadedSpec, name: str, meta: dict, labels: dict, jobs: dict[str, dict]
) -> dict[str, Any]:
    """One JobSet holding every role's Job: a failed Job restarts the whole set (a gang restart)."""
    spec = loaded.spec
    budget = spec.restart.max_restarts if spec.restart.policy == "on-failure" else 0
    training = [role for role in jobs if role != contract.EVALUATOR]
    # PSS: the chief decides, and the set's end stops the servers that never end on their own.
    decides = [contract.CHIEF] if spec.strategy == contract.PSS else training
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": name, **meta, "labels": labels},
        "spec": {
            # JobSet creates the headless Service <name> and gives pods their hostnames.
            "network": {
                "enableDNSHostnames": True,
                "subdomain": name,
                "publishNotReadyAddresses": True,
            },
            "successPolicy": {"operator": "All", "targetReplicatedJobs": decides},
            "failurePolicy": {
                "maxRestarts": budget,
                # A non-retryable exit code (the Job's podFailurePolicy) or the run's time limit
                # ends the set; any other Job failure restarts all of it.
                "rules": [
                    {
                        "name": "NotRetryable",
                        "action": "FailJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy", "DeadlineExceeded"],
                    }
                ],
            },
            "ttlSecondsAfterFinished": spec.kubernetes.ttl_s,
            "replicatedJobs": [
                {
                    "name": role,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": {**labels, ROLE_LABEL: role}},
                        "spec": job,
                    },
                }
                for role, job in jobs.items()
            ],
        },
    }


def _notes(loaded: LoadedSpec, jobset: bool) -> tuple[str, ...]:
    """What the user must do or know that the manifests cannot say."""
    spec = loaded.spec
    notes = []
    if not spec.kubernetes.pvc:
        notes.append(
            "no kubernetes.pvc in the spec: each pod's run dir is an emptyDir, lost with the pod "
            "(checkpoints do not survive a retry)"
        )
    if jobset:
        return tuple(notes)
    if spec.strategy != contract.PSS and spec.restart.policy == "on-failure":
        notes.append(
            "a Job retries a failed pod alone, but MWMS needs every training task restarted together: "
            "use --jobset for a gang restart"
        )
    return tuple(notes)


def _check_fits(loaded: LoadedSpec, where: Placements) -> None:
    """Refuse what pods cannot run (``where``: the spec's placement), naming the spec's JSON path."""
    file = loaded.shown
    refuse_elastic(loaded.spec, file, "kubernetes")
    for role, rows in where.by_role().items():
        for row in rows:
            if row.transport == TaskTransport.SSH:
                raise SpecError(
                    file,
                    task_json_path(loaded.raw, role, row.index, "host"),
                    "Kubernetes places pods itself; expected no SSH host for `distlaunch k8s`",
                )
        for row in rows:
            if row.cpus.how == CpuHow.LISTED:
                raise SpecError(
                    file,
                    task_json_path(loaded.raw, role, row.index, "cpus"),
                    'Kubernetes picks a pod\'s CPUs (its static CPU manager); expected a CPU count, "auto" or "all"',
                )
        if len({row.cpus.count for row in rows}) > 1:
            raise SpecError(
                file,
                task_json_path(loaded.raw, role, 0, "cpus"),
                f"one Indexed Job runs every {role} task from one pod template; expected the same CPU count for each",
            )
        if len({len(row.gpus) for row in rows}) > 1:
            raise SpecError(
                file,
                task_json_path(loaded.raw, role, 0, "gpus"),
                f"one Indexed Job runs every {role} task from one pod template; expected the same GPU count for each",
            )
    for key in loaded.spec.program.env:
        if not _ENV_NAME.match(key):
            raise SpecError(
                file,
                f"$.program.env.{key}",
                'Kubernetes accepts env names of printable ASCII characters only (no "=")',
            )


def _literal(value: str) -> str:
    # Kubernetes expands $(VAR) in command and env values, and reads $$ as one $.
    return value.replace("$", "$$")
