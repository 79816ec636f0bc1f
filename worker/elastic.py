"""The batch of an elastic run at the world size it has now.

An elastic run (the spec's ``elastic`` section) restarts its gang at another number of workers
from the latest checkpoint. The program's batch numbers were written once; the launcher says how
they follow the world, in three variables (worker/contract.py): ELASTIC_BATCH, the rule;
WORLD_SIZE, the workers of this world; BASE_WORKERS, the world the numbers were written for
(the range's MAX).

- ``global`` (the default): the global batch stays, so the loss curve and the learning rate mean
  the same at every size; each worker takes ``global / world``. A global batch that does not
  divide over this world is refused in one line (exit 2) before training: ``elastic.sizes`` lists
  the sizes the program accepts, and the launcher skips the others.
- ``per_worker``: each worker's batch stays (``global / BASE_WORKERS``), so the global batch is
  ``per-worker * world``: what a program tuned for its per-device memory wants. The learning rate
  is then the program's concern (docs/training-scripts.md, its section on elastic runs: scale it with ``dw.context()``).

Under ParameterServerStrategy a step is one worker's batch whatever the number of workers: the
rule changes nothing there. Outside an elastic run nothing here changes any batch or prints
anything. Standard library only: the launcher imports nothing from here, but a program may call
`global_batch_size` before it imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import NoReturn

from . import contract, runtime

GLOBAL, PER_WORKER = contract.ELASTIC_BATCH_RULES

_said: set[str] = set()  # the lines already printed by this process (one line per world)


class ElasticBatchError(ValueError):
    """The program's batch cannot follow the elastic rule at this world size (one line)."""


@dataclasses.dataclass(frozen=True)
class WorldBatch:
    """The batch of one training step in this world.

    ``rule``: contract.ELASTIC_BATCH's value, None outside an elastic run; ``world``: the workers
    of this world; ``base``: the workers the program's numbers were written for; ``world_name``:
    how the launcher names the world (e.g. ``2 of 2:3``); ``global_size``: the batch of one step
    over all workers; ``per_worker``: each worker's part (under PSS: one worker's batch is a step).
    """

    rule: str | None
    world: int
    base: int
    world_name: str
    global_size: int
    per_worker: int
    scheduled: bool = False

    def line(self) -> str:
        """The line that says the batch of this world, e.g.
        ``distlaunch: world 2 of 2:3 workers: global batch 64, 32 per worker``."""
        where = f"distlaunch: world {self.world_name} workers"
        if self.scheduled:
            return (
                f"{where}: each step is one worker's batch of {self.global_size} (parameter server)"
            )
        return f"{where}: global batch {self.global_size}, {self.per_worker} per worker"


def world_batch(global_batch_size: int, ctx: runtime.TaskContext | None = None) -> WorldBatch:
    """The batch of a step in this world, for a program written with ``global_batch_size``.

    Raises ElasticBatchError when the rule cannot be kept at this world size, and ValueError for
    a rule or size in the environment that the launcher would never set.
    """
    ctx = ctx or runtime.context()
    rule, world, base, name = _world(ctx)
    scheduled = ctx.strategy == contract.PSS
    size = global_batch_size
    if rule is not None and not scheduled:
        if rule == PER_WORKER:
            if global_batch_size % base:
                raise ElasticBatchError(
                    f"global batch {global_batch_size} does not divide over the {base} workers it "
                    f'was written for (elastic.batch "per_worker"): make it a multiple of {base}'
                )
            size = global_batch_size // base * world
        elif global_batch_size % world:
            fits = [k for k in range(1, base + 1) if global_batch_size % k == 0]
            raise ElasticBatchError(
                f"global batch {global_batch_size} does not divide over {world} workers "
                f'(elastic.batch "global"): list the sizes that divide it in elastic.sizes '
                f'({fits} here), or set elastic.batch to "per_worker"'
            )
    return WorldBatch(rule, world, base, name, size, size // world, scheduled)


def global_batch_size(global_batch_size: int) -> int:
    """The global batch to batch a dataset with in this world, for a program written with
    ``global_batch_size``; in an elastic run, say it in one line (once per process).

    For ``model.fit`` programs (tf_keras, Keras 3), whose dataset MultiWorkerMirroredStrategy
    splits over the workers: ``dataset.batch(dw.global_batch_size(64))``. Outside an elastic run
    it returns ``global_batch_size`` unchanged. A batch the rule cannot keep at this world size
    stops the task in one line, exit code 2 (`refuse`).
    """
    try:
        batch = world_batch(global_batch_size)
    except ElasticBatchError as exc:
        refuse(exc)
    say(batch)
    return batch.global_size


def say(batch: WorldBatch) -> None:
    """Print ``batch``'s line in an elastic run, once per process and world."""
    if batch.rule is None:
        return
    line = batch.line()
    if line not in _said:
        _said.add(line)
        print(line, flush=True)


def say_world(ctx: runtime.TaskContext | None = None) -> None:
    """In an elastic run, say the world in one line unless its batch line was said: for
    ``model.fit`` programs, whose batch is the dataset's (`keras_callbacks` calls this)."""
    rule, _world_size, _base, name = _world(ctx or runtime.context())
    if rule is None or _said:
        return
    line = (
        f"distlaunch: world {name} workers: the batch is the dataset's "
        f"(batch it at dw.global_batch_size(N) to follow elastic.batch {rule!r})"
    )
    _said.add(line)
    print(line, flush=True)


def refuse(exc: Exception) -> NoReturn:
    """Stop the task in one line (also in the error file for the launcher), exit code 2: the
    program is wrong for this world, and no restart at the same size can succeed."""
    try:
        runtime._write_error_file(type(exc), exc, None)
    except OSError:
        pass  # the line below still says it
    print(f"distlaunch: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(contract.EXIT_FATAL)


def _world(ctx: runtime.TaskContext) -> tuple[str | None, int, int, str]:
    """The elastic rule (None: not elastic), the world size, the base size and the world's name,
    from the launcher's variables; ValueError for a value the launcher would never set."""
    rule = os.environ.get(contract.ELASTIC_BATCH) or None
    if rule is not None and rule not in contract.ELASTIC_BATCH_RULES:
        rules = list(contract.ELASTIC_BATCH_RULES)
        raise ValueError(f"{contract.ELASTIC_BATCH}={rule!r} is not one of {rules}")
    world = _positive(contract.WORLD_SIZE, ctx.num_workers)
    base = _positive(contract.BASE_WORKERS, world)
    return rule, world, base, os.environ.get(contract.WORLD) or f"{world} of {base}"


def _positive(name: str, default: int) -> int:
    """The positive integer in environment variable ``name``, or ``default`` when unset."""
    value = os.environ.get(name)
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r} is not a positive number of workers")
    return int(value)
