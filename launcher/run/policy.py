"""What a task's exit means for the run: one small object that returns a decision and says why.

The supervisor feeds it events (a task exited, stopped making progress, a user asked for a
restart, a deadline passed, the cluster never formed, the evaluator's drain ended, a stop
notice came, a first or a second one, while tasks started or after training was done, a save
missed its deadline: every way a run ends is an event decided here) and the run's history
(which holds the facts a notice is decided on); it answers with an action, the tasks
it concerns, a delay and a reason, which the supervisor logs to events.jsonl. Nothing here
touches a process, so scripted inputs test every branch.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from distlaunch.launcher.record.endings import EventKind
from distlaunch.worker import contract

# Exceptions that mean the program itself is wrong: starting it again cannot help.
NON_RETRYABLE_ERRORS = (
    "SyntaxError",
    "IndentationError",
    "TabError",
    "ImportError",
    "ModuleNotFoundError",
    # dw.fit's resume found checkpoints but none whole (worker/resume.py)
    "distlaunch.worker.resume.CheckpointDamaged",
)


class Action(enum.Enum):
    """What the supervisor does next."""

    CONTINUE = "continue"  # keep going; nothing to do
    DONE = "done"  # the job succeeded: stop whatever still runs (servers, the evaluator)
    RESTART = "restart"  # stop the named tasks that still run, then start them all again
    FAIL = "fail"  # the job failed: stop everything and report this task as the root cause
    # After a stop notice: every training task saved and stopped; stop whatever still runs
    PREEMPTED = "preempted"
    STOP = "stop"  # after a stop notice, a task did not save: stop everything, as a signal does
    NOTIFY = "notify"  # a stop notice: ask every training task to save and stop
    # An elastic run's world changes (launcher/run/elastic.py): without ``tasks``, the gang
    # stops while the world is decided; with them, it restarts as those tasks of a new world.
    RESIZE = "resize"


@dataclass(frozen=True)
class Decision:
    """An action, the tasks it concerns, how long to wait first, and the reason (logged).

    ``note`` is, for a FAIL, why the policy did not restart the task (shown under the failure
    summary); empty when the run was never going to restart anything (policy "never").
    """

    action: Action
    reason: str
    tasks: tuple[str, ...] = ()
    delay_s: float = 0.0
    note: str = ""
    # FAIL: the task to report as the root cause. It is the event's task, unless that task only
    # lost a peer: then the first task that failed on its own, or None when none is known yet.
    cause: str | None = None
    crash_loop: bool = False  # FAIL: the same traceback as the failure before the last restart
    spent: bool = (
        False  # FAIL: the restart budget is exhausted (an elastic run holds out the place)
    )


# The launcher's own deadlines: no restart can help a run that hit them.
_DEADLINES = (EventKind.STARTUP_TIMEOUT, EventKind.FORMATION, EventKind.RUN_TIMEOUT)


@dataclass(frozen=True)
class TaskEvent:
    """Something happened to a task (``kind``): it exited (``returncode``), hung, a restart was
    asked for, a deadline passed, or the evaluator's drain ended.

    ``returncode`` is the exit code of an EXITED (or DRAINED) task, else None; ``detail`` is the
    supervisor's words for a deadline or drain (e.g. "did not start ... (timeouts.startup_s)");
    ``error_type`` is the exception type from the task's error file, when it wrote one.
    ``peer_lost``: its error is a follow-on error of another task's death (UnavailableError,
    "socket closed", the coordination service's).
    ``fingerprint``: its traceback reduced to what repeats in a crash loop (type, message, frames);
    ``lost_peers``: the tasks a follow-on error names as lost (TensorFlow lists them).
    """

    name: str
    role: str
    returncode: int | None
    error_type: str | None = None
    kind: EventKind = EventKind.EXITED
    peer_lost: bool = False
    fingerprint: str | None = None
    lost_peers: tuple[str, ...] = ()  # the tasks its follow-on error names as lost
    detail: str = ""

    @property
    def manual(self) -> bool:
        """Whether a user asked for this restart."""
        return self.kind is EventKind.MANUAL


@dataclass(frozen=True)
class History:
    """What the policy knows of the run so far, besides the event.

    ``restart_times``: times of earlier automatic restarts (budget, backoff); ``peer_lost``: tasks
    of the current attempt that exited with a follow-on error; ``last_fingerprint``: the traceback
    fingerprint of the failure that caused the latest automatic restart.
    """

    restart_times: Sequence[float] = ()
    peer_lost: frozenset[str] = frozenset()
    last_fingerprint: str | None = None
    # Stop notices (and the facts they are decided on; see `RestartPolicy._on_notice`):
    notices: int = 0  # how many stop notices the run had before this event
    training_done: bool = False  # the chief marked this attempt's training done
    # Why a notice cannot be kept, "" when it can: the program cannot save on one, the transport
    # cannot deliver one, a task is down waiting to restart.
    unkeepable: str = ""
    # Training tasks whose notice is still held: they have not started far enough to take it
    # (importing TensorFlow, building the strategy), so no step of this attempt has run.
    held: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RestartRules:
    """The spec's restart settings, as the policy needs them."""

    policy: str = "never"  # "never" | "on-failure"
    max_restarts: int = 3
    window_s: float | None = None
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    non_retryable_exit_codes: tuple[int, ...] = (2,)


@dataclass(frozen=True)
class Cluster:
    """The tasks of a run by role (names like ``worker-1``)."""

    strategy: str
    roles: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def training(self) -> list[str]:
        """Every task that is part of the training cluster (all but the evaluator)."""
        return [
            n for role, names in self.roles.items() if role != contract.EVALUATOR for n in names
        ]

    def savers(self) -> list[str]:
        """The tasks a stop notice goes to: every training task; under PSS the chief alone (its
        ps and worker servers hold the variables and run its steps until it has saved)."""
        if self.strategy == contract.PSS:
            return list(self.roles.get("chief", ()))
        return self.training()


class RestartPolicy:
    """Decides what each event means under the run's strategy and restart rules.

    MWMS: every training task must exit 0. A failure restarts the whole gang: all-reduce peers
    cannot continue without the lost worker, and waiting for survivors to notice takes long
    across hosts, so they are stopped at once.
    PSS: ps and worker tasks run servers that never exit on their own. A worker's failure restarts
    that worker alone (the coordinator re-queues its closures and waits for it); a ps's restarts
    the ps and the chief (variables live on the ps: the chief restores them from its checkpoint);
    the chief's restarts the chief. The job is done when the chief exits 0.
    The evaluator is a sidecar: its success changes nothing, its failure restarts only itself.
    The run's own deadlines (startup_s, formation_s, run_s) fail it whatever the rules; the end
    of the evaluator's drain after training (it finished, or its time ran out) is DONE.
    A stop notice (NOTICE) is a state of the run, not an accident: the first one is sent to the
    training tasks (NOTIFY), unless training is done (DONE: the run succeeded; an evaluator still
    draining is cut) or it cannot be kept (STOP); a second one joins the save under way
    (CONTINUE); a third stops at once (STOP). After a notice nothing restarts: once every
    training task (PSS: the chief) exited "preempted" or done (contract.EXIT_CODES) the run is
    PREEMPTED (DONE when none saved: training had finished); a task that exits otherwise STOPs
    it, and so does a save that misses timeouts.save_s, unless a task's notice was still held
    then: nothing of that attempt had trained, so it is PREEMPTED where it resumed.
    """

    def __init__(self, cluster: Cluster, rules: RestartRules) -> None:
        self.cluster = cluster
        self.rules = rules

    def decide(
        self,
        event: TaskEvent,
        exited: Mapping[str, int],
        history: History,
        now: float,
    ) -> Decision:
        """Decide after ``event``.

        ``exited`` maps each task that has ended in the current attempt to its return code, in the
        order they exited; ``history`` is what the run went through before (restarts, for the
        budget and backoff; follow-on failures; the last crash's fingerprint).
        """
        decision = self._decide(event, exited, history, now)
        if decision.action is not Action.FAIL:
            return decision
        return replace(decision, cause=_cause(event, exited, history))

    def _decide(
        self, event: TaskEvent, exited: Mapping[str, int], history: History, now: float
    ) -> Decision:
        restart_times = history.restart_times
        if event.kind is EventKind.DRAINED:
            # Training was done before: the evaluator finished, or its drain time ran out.
            return Decision(Action.DONE, event.detail)
        if event.kind is EventKind.NOTICE:
            return _on_notice(event, history)
        if event.kind is EventKind.SAVE_TIMEOUT:
            if history.held:
                held = ", ".join(sorted(history.held))
                return Decision(
                    Action.PREEMPTED,
                    f"{held} never started far enough to take the notice: nothing was trained "
                    "in this attempt, so nothing is lost",
                )
            return Decision(Action.STOP, f"{event.name} {event.detail}")
        if event.kind is EventKind.PREEMPTED:
            return self._after_notice(event, exited, history)
        if event.kind in _DEADLINES:
            # The limits the user set for the whole run: the run ends, whatever the policy.
            return Decision(Action.FAIL, f"{event.name} {event.detail}")
        server = self.cluster.strategy == contract.PSS and event.role in (
            contract.PS,
            contract.WORKER,
        )
        # A PSS server that exits, even with 0, is broken: it is handled like a failure.
        if event.returncode == 0 and not event.manual and not server:
            return self._clean_exit(event, exited)
        restart = self._restart_set(event)
        if event.manual:
            return Decision(Action.RESTART, f"restart of {event.name} requested", restart)
        what = _describe(event)
        if self.rules.policy == "never":
            return Decision(Action.FAIL, f"{event.name} {what}; restart policy is never")
        if event.returncode in self.rules.non_retryable_exit_codes:
            reason = f"{event.name} {what}, which means the program is wrong: not retried"
            return Decision(Action.FAIL, reason, note=reason)
        if event.error_type in NON_RETRYABLE_ERRORS:
            reason = (
                f"{event.name} {what} with {event.error_type}: the program is wrong, not retried"
            )
            return Decision(Action.FAIL, reason, note=reason)
        if event.fingerprint is not None and event.fingerprint == history.last_fingerprint:
            note = "the same traceback as before the last restart: a crash loop, not retried"
            return Decision(Action.FAIL, f"{event.name} {what}; {note}", note=note, crash_loop=True)
        recent = [
            t
            for t in restart_times
            if self.rules.window_s is None or now - t <= self.rules.window_s
        ]
        if len(recent) >= self.rules.max_restarts:
            window = f" within {self.rules.window_s:g} s" if self.rules.window_s is not None else ""
            why = f"restart budget exhausted ({len(recent)} of {self.rules.max_restarts} restarts used{window})"
            return Decision(Action.FAIL, f"{event.name} {what}; {why}", note=why, spent=True)
        # The exponent is capped: 2 ** 1024 does not fit a float, and 2 ** 64 exceeds any max_s.
        exponent = min(len(recent), 64)
        delay = min(self.rules.initial_backoff_s * 2.0**exponent, self.rules.max_backoff_s)
        return Decision(
            Action.RESTART,
            f"{event.name} {what}: restarting {', '.join(restart)} (restart {len(recent) + 1} of {self.rules.max_restarts})",
            restart,
            delay,
        )

    def _clean_exit(self, event: TaskEvent, exited: Mapping[str, int]) -> Decision:
        if event.role == contract.EVALUATOR:
            return Decision(Action.CONTINUE, "the evaluator finished")
        if self.cluster.strategy == contract.PSS:
            return Decision(Action.DONE, "the chief (coordinator) finished")
        if all(exited.get(name) == 0 for name in self.cluster.training()):
            return Decision(Action.DONE, "every training task finished")
        return Decision(Action.CONTINUE, f"{event.name} finished; waiting for the others")

    def _after_notice(
        self, event: TaskEvent, exited: Mapping[str, int], history: History
    ) -> Decision:
        """A task exited after the stop notice: did every training task save, or finish?

        Saved (75, or 42/143 after a notice) and finished (0) both count as stopped well: ranks
        of a program with its own handler need not be at the same place (one in its last step
        exits 0, another saves), and waiting for all of one kind would never end.
        """
        assert event.returncode is not None
        fatal = self.rules.non_retryable_exit_codes

        def meaning(code: int) -> contract.ExitMeaning:
            return contract.exit_meaning(code, noticed=True, fatal=fatal)

        ended_well = (contract.ExitMeaning.DONE, contract.ExitMeaning.PREEMPTED)
        if event.role == contract.EVALUATOR:
            return Decision(Action.CONTINUE, "the evaluator stopped on the notice")
        if meaning(event.returncode) not in ended_well:
            return Decision(
                Action.STOP, f"{event.name} {_describe(event)} after the stop notice, unsaved"
            )
        server = self.cluster.strategy == contract.PSS and event.role != contract.CHIEF
        if server:
            return Decision(Action.CONTINUE, f"{event.name} stopped; waiting for the chief")
        deciders = (
            list(self.cluster.roles.get(contract.CHIEF, ()))
            if self.cluster.strategy == contract.PSS
            else self.cluster.training()
        )
        waiting = [n for n in deciders if n not in exited or meaning(exited[n]) not in ended_well]
        if waiting:
            how = "finished" if event.returncode == 0 else "saved and stopped"
            return Decision(
                Action.CONTINUE, f"{event.name} {how}; waiting for {', '.join(waiting)}"
            )
        saved = [n for n in deciders if meaning(exited[n]) is contract.ExitMeaning.PREEMPTED]
        if history.training_done or not saved:
            return Decision(Action.DONE, "training was done when the notice came")
        if len(saved) < len(deciders):
            finished = ", ".join(n for n in deciders if n not in saved)
            return Decision(
                Action.PREEMPTED,
                f"{', '.join(saved)} saved and stopped, {finished} finished: resume continues "
                "from the saved step",
            )
        if self.cluster.strategy == contract.PSS:
            return Decision(Action.PREEMPTED, "the chief saved and stopped")
        return Decision(Action.PREEMPTED, "every training task saved and stopped")

    def _restart_set(self, event: TaskEvent) -> tuple[str, ...]:
        roles = self.cluster.roles
        if event.role == contract.EVALUATOR:
            return (event.name,)
        if self.cluster.strategy == contract.PSS:
            if event.role == contract.WORKER:
                return (event.name,)
            chief = tuple(roles.get(contract.CHIEF, ()))
            return (event.name, *chief) if event.role == contract.PS else chief
        return tuple(self.cluster.training())


def _on_notice(event: TaskEvent, history: History) -> Decision:
    """A stop notice (``event.detail``: the signal's name) came: send it, join the one under way,
    or end the run."""
    if history.notices == 1:
        return Decision(
            Action.CONTINUE, f"another stop notice ({event.detail}) joins the save under way"
        )
    if history.notices > 1:
        return Decision(
            Action.STOP, f"a third stop signal ({event.detail}) during the save: stopping at once"
        )
    if history.training_done:
        return Decision(Action.DONE, "training was done when the notice came")
    if history.unkeepable:
        return Decision(Action.STOP, history.unkeepable)
    return Decision(Action.NOTIFY, f"stop notice ({event.detail})")


def _cause(event: TaskEvent, exited: Mapping[str, int], history: History) -> str | None:
    """The task to blame for a failure: the event's, unless it only lost a peer; then the first
    task of this attempt that failed on its own, else the one the error names as lost (None:
    neither is known)."""
    if not event.peer_lost:
        return event.name
    died = (
        name
        for name, code in exited.items()
        if code != 0 and name != event.name and name not in history.peer_lost
    )
    # No task has died on its own: the one TensorFlow says stopped answering (frozen, or its
    # machine gone) is the cause, though its process may still be there.
    named = (n for n in event.lost_peers if n != event.name and n not in history.peer_lost)
    return next(died, None) or next(named, None)


def _describe(event: TaskEvent) -> str:
    if event.kind is EventKind.HUNG:
        return "stopped making progress"
    if event.returncode == 0:
        return "exited on its own (its server must run until the chief is done)"
    if event.returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-event.returncode).name}"
        except ValueError:
            return f"was killed by signal {-event.returncode}"
    return f"exited with code {event.returncode}"
