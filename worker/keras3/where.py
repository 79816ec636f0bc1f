"""Where this task stands in a multi-worker MWMS cluster: the questions every patch asks."""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf


def multi_worker(strategy: Any) -> bool:
    """Whether ``strategy`` is MultiWorkerMirroredStrategy over more than one worker."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        strategy.extended._in_multi_worker_mode()
    )


def is_chief(strategy: Any) -> bool:
    """Whether this task writes the user's paths: the chief, else worker 0 where there is none;
    every process outside multi-worker MWMS."""
    if strategy is None or not multi_worker(strategy):
        return True
    resolver = strategy.cluster_resolver
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type == "chief":
        return True
    return task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().jobs


def write_dir(path: str, strategy: Any) -> str:
    """Where this task writes what belongs in folder ``path`` (tf_keras's write_dirpath)."""
    if is_chief(strategy):
        return path
    return os.path.join(path, f"workertemp_{strategy.cluster_resolver.task_id}")
