"""How a task or a run ends: the kinds that the policy's events, the failure summary and
run.json's failure share (typed, so that nothing matches the words shown to tell them apart)."""

from __future__ import annotations

import enum


class EventKind(enum.StrEnum):
    """What happened to a task; also the kind of a run's failure, as run.json records it."""

    EXITED = "exited"  # its process ended on its own (``returncode``)
    HUNG = "hung"  # it stopped making progress and was killed (heartbeat_s, silence_s)
    MANUAL = "manual"  # a user asked for its restart (`distlaunch restart`)
    STARTUP_TIMEOUT = "startup timeout"  # no TensorFlow server within timeouts.startup_s
    FORMATION = "formation"  # it never connected to the coordination service (formation_s)
    RUN_TIMEOUT = "run timeout"  # the run hit timeouts.run_s while it ran or waited to restart
    DRAINED = "drained"  # training was done and the evaluator finished or ran out of drain time
    # After a stop notice: it exited (``returncode``; contract.EXIT_CODES says if it saved first)
    PREEMPTED = "preempted"
    NOTICE = "notice"  # the run got a stop notice (``detail``: the signal's name)
    SAVE_TIMEOUT = "save timeout"  # a stop notice's save did not end within timeouts.save_s
