"""TF_CONFIG for every role, exactly as TensorFlow's TFConfigClusterResolver expects it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from distlaunch.worker import contract

# Roles that form the training cluster, in the order TensorFlow lists them.
TRAINING_ROLES = (contract.CHIEF, contract.WORKER, contract.PS)


def training_cluster(addresses: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Return the training cluster: chief, worker and ps addresses (never the evaluator).

    The evaluator is a sidecar: if it were listed, MWMS workers and the PS coordinator would wait
    for it to join collectives it never runs.
    """
    return {role: list(addresses[role]) for role in TRAINING_ROLES if addresses.get(role)}


def tf_config(addresses: Mapping[str, Sequence[str]], role: str, index: int) -> dict:
    """Return the TF_CONFIG dict of task ``role:index`` given every role's addresses.

    Training tasks get the training cluster; the evaluator gets a cluster of its own, so nothing
    in the training cluster ever waits for it.
    """
    if role == contract.EVALUATOR:
        cluster = {contract.EVALUATOR: [addresses[contract.EVALUATOR][index]]}
    else:
        cluster = training_cluster(addresses)
    if role not in cluster or index >= len(cluster[role]):
        raise ValueError(f"no task {role}:{index} in the cluster")
    return {"cluster": cluster, "task": {"type": role, "index": index}}


def dumps(config: Mapping) -> str:
    """Serialise TF_CONFIG compactly, the way it goes into the environment."""
    return json.dumps(config, separators=(",", ":"))
