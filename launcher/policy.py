"""What a task's exit means for the run: one small object that returns a decision and says why."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from distlaunch.worker import contract


class Action(enum.Enum):
    """What the supervisor does next."""

    CONTINUE = "continue"  # keep going; nothing to do
    DONE = "done"  # the job succeeded: stop whatever still runs (servers, the evaluator)
    FAIL = "fail"  # the job failed: stop everything and report this task as the root cause


@dataclass(frozen=True)
class Decision:
    """An action and the reason, logged to events.jsonl."""

    action: Action
    reason: str


@dataclass(frozen=True)
class ExitEvent:
    """A task process ended."""

    name: str
    role: str
    returncode: int


class ExitPolicy:
    """Decides what a task exit means under each strategy.

    MWMS: every training task must exit 0; any other exit fails the job.
    PSS: ps and worker tasks run servers that never exit on their own, so their exit is a failure;
    the job is done when the chief (the coordinator) exits 0.
    The evaluator is a sidecar: its failure fails the job, its success changes nothing.
    """

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy

    def decide(self, event: ExitEvent, exited: Mapping[str, int], training: set[str]) -> Decision:
        """Decide after ``event``; ``exited`` maps each ended task to its code, ``training`` names the training tasks."""
        if event.returncode != 0:
            return Decision(Action.FAIL, f"{event.name} failed")
        if event.role == "evaluator":
            return Decision(Action.CONTINUE, "the evaluator finished")
        if self.strategy == contract.PSS:
            if event.role == "chief":
                return Decision(Action.DONE, "the chief (coordinator) finished")
            return Decision(Action.FAIL, f"{event.name} is a server and must not exit on its own")
        if all(exited.get(name) == 0 for name in training):
            return Decision(Action.DONE, "every training task finished")
        return Decision(Action.CONTINUE, f"{event.name} finished; waiting for the others")
