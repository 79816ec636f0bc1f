"""The plan of one world of an elastic run: which worker slots train now, and what each task is
told about it.

`make_plan` plans every worker slot the spec allows (elastic.workers' MAX): the FULL plan. A world
is a choice of those slots; `world_plan` (pure) keeps the non-worker tasks and the chosen worker
slots, renumbers the workers 0..k-1 in slot order (TensorFlow's task index: under MWMS without a
chief role, worker 0 is the chief), and rewrites what names the cluster or the index: TF_CONFIG
(every training task's cluster; the evaluator's is its own and stays), DISTLAUNCH_INDEX, the
error, status and metrics files, and the env that names the world. Ports, hosts, GPUs and CPUs
belong to the slot and stay with it.

Task names follow the world: ``worker-1`` is the second worker of the current world, wherever
its slot is; run.json's ``world`` says which slot (and host) each name holds now, and every
``resized`` event names the hosts of the new world.

The range and the slots are `elastic.ElasticPlan`'s (`Plan.elastic`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from distlaunch.launcher.plan import tfconfig
from distlaunch.worker import contract

if TYPE_CHECKING:
    from distlaunch.launcher.plan.plan import Plan, TaskPlan


def world_plan(full: Plan, slots: Sequence[str]) -> Plan:
    """The plan of the world made of worker ``slots`` (names of the full plan's workers): the
    non-worker tasks and those workers, renumbered in slot order, every TF_CONFIG and the env
    that names the index or the world rewritten; ports kept. ValueError for a name that is no
    worker slot of ``full``, or a plan that is not elastic."""
    elastic = full.elastic
    if elastic is None:
        raise ValueError("world_plan needs an elastic plan")
    chosen = set(slots)
    workers = [t for t in full.tasks if t.role == contract.WORKER]
    unknown = chosen - {t.name for t in workers}
    if unknown:
        raise ValueError(f"no worker slot {', '.join(sorted(unknown))} in the plan")
    index = {t.name: i for i, t in enumerate(w for w in workers if w.name in chosen)}
    kept = [t for t in full.tasks if t.role != contract.WORKER or t.name in chosen]
    numbered = [(t, index.get(t.name, t.index)) for t in kept]
    addresses: dict[str, list[str]] = {}
    for task, i in numbered:
        addresses.setdefault(task.role, []).append(task.address)
    size = len(index)
    world_env = {
        contract.ELASTIC_BATCH: elastic.batch,
        contract.WORLD_SIZE: str(size),
        contract.BASE_WORKERS: str(elastic.max_workers),
        contract.WORLD: f"{size} of {elastic.range_text}",
    }
    run_dir = Path(full.run_dir)
    tasks = [_renumbered(t, i, addresses, world_env, run_dir) for t, i in numbered]
    return replace(full, tasks=tuple(tasks))


def _renumbered(
    task: TaskPlan, index: int, addresses: dict[str, list[str]], world_env: dict, run_dir: Path
) -> TaskPlan:
    """``task`` as task ``index`` of its role in the cluster of ``addresses``."""
    role, attempt = task.role, task.attempt
    if role == contract.EVALUATOR:
        config = task.tf_config  # a cluster of its own: nothing of the world's
    else:
        config = tfconfig.tf_config(addresses, role, index)
    env = dict(task.env)
    env.update(world_env)
    env.update(
        {
            contract.TF_CONFIG: tfconfig.dumps(config),
            contract.INDEX: str(index),
            contract.ERROR_FILE: str(contract.error_path(run_dir, attempt, role, index)),
            contract.STATUS_FILE: str(contract.status_path(run_dir, role, index)),
            contract.METRICS_FILE: str(contract.metrics_path(run_dir, role, index)),
        }
    )
    log_file = str(contract.log_path(run_dir, attempt, role, index))
    return replace(task, index=index, tf_config=config, env=env, log_file=log_file)
