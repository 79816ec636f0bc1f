"""Each task's own GPUs out of the GPUs its agent's Slurm step holds.

On a Slurm node one agent step holds the GPUs of all the node's tasks (``--gpus-per-task=`` their
sum) and Slurm names them in the step's ``CUDA_VISIBLE_DEVICES``; the step's processes, each task
included, would all see all of them, and two tasks would train on the same GPU 0. So the
launcher gives each task's request its *share*: the positions of its GPUs in that list
(`positions`: its indices' places among every index the node's tasks hold), and the agent,
which alone sees the step's list, turns them into the task's own devices (`with_share`) before
its keeper starts it. The devices themselves are Slurm's to pick (which physical GPUs, in what
order, renumbered or not by a cgroup): only the list the step got is trusted, never an index.

Standard library only, and no launcher code: the agent loads it by path on the node.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Mapping, Sequence

# The request's key: the task's positions in its step's GPU list.
SHARE = "gpu_share"
# The variables in which Slurm names a step's GPUs, in the same order (CUDA's, the AMD and
# generic ordinals): each one the step has is cut to the task's share alike.
GPU_LISTS = ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES")


class NoShare(OSError):
    """The step does not hold the GPUs a task's share names (ENODEV): that task cannot start,
    and the agent reports it as a task whose keeper could not start."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENODEV, message)


def positions(own: Sequence[int], node: Iterable[Sequence[int]]) -> list[int]:
    """Where each of ``own`` (one task's GPU indices) stands among every index that ``node``
    (the GPU indices of each task on that node, ``own``'s included) holds, in ascending order:
    the task's places in the list of GPUs of the node's step."""
    ranked = sorted({gpu for gpus in node for gpu in gpus} | set(own))
    return [ranked.index(gpu) for gpu in own]


def with_share(request: dict, environ: Mapping[str, str]) -> dict:
    """``request`` (a keeper's) with its task's own GPUs in its env, cut from the step's lists
    in ``environ`` (the agent's environment); ``request`` itself when it names no share.
    Raises NoShare when the share is malformed or names a GPU the step does not hold."""
    share = request.get(SHARE)
    if share is None:
        return request
    if not (isinstance(share, list) and all(type(p) is int and p >= 0 for p in share)):
        raise NoShare(f"the task's GPU share is not a list of positions: {share!r}")
    held = _listed(environ.get(GPU_LISTS[0]))
    if share and max(share) >= len(held):
        raise NoShare(
            f"the task is given GPUs {share} of its step's, but the step holds {len(held)} "
            f"({GPU_LISTS[0]}={environ.get(GPU_LISTS[0], '')!r}; unset: Slurm named none)"
        )
    env = dict(request.get("env") or {})
    for name in GPU_LISTS:
        listed = _listed(environ.get(name))
        if name == GPU_LISTS[0] or len(listed) == len(held):
            env[name] = ",".join(listed[p] for p in share)
    return {**{k: v for k, v in request.items() if k != SHARE}, "env": env}


def _listed(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]
