"""An elastic run's resizes carried out: the gang stopped at a loss, the save before a grow, the
restart in the new world.

`Events` hands each decision about the world here (`policy.Action.RESIZE`): without tasks it
stops the gang at once (a place was lost or held out: waiting for TensorFlow's collectives to
notice would take tens of seconds across hosts) while `elastic.World` decides the world; with
tasks it is a new world, started at once when the gang is down, else after a save at a step the
workers agree on (the stop-notice path, `notice.StopNotices` with ``resize``: 0 steps lost).
Once the save is done (or cut short: then from the latest checkpoint), the world's plan replaces
the attempt's (`Restarts.resize`), its tasks the crew's (`Crew.adopt`), and the restart policy
and the notices learn the new cluster. Each new world is a ``resized`` event in events.jsonl.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from distlaunch.launcher.core.console import Console
from distlaunch.launcher.plan.plan import Plan
from distlaunch.launcher.run.crew import Crew
from distlaunch.launcher.run.elastic import World
from distlaunch.launcher.run.journal import Journal
from distlaunch.launcher.run.membership import Resize, Verdict
from distlaunch.launcher.run.notice import StopNotices
from distlaunch.launcher.run.policy import Action, Cluster, Decision, RestartPolicy, TaskEvent
from distlaunch.launcher.run.restarts import Restarts
from distlaunch.launcher.run.task import Task
from distlaunch.launcher.run.warm import WarmStandbys
from distlaunch.launcher.transports.base import Transport
from distlaunch.worker import contract


class Resizing:
    """Carries out an elastic run's world changes through the supervisor's collaborators."""

    def __init__(
        self,
        world: World,
        console: Console,
        transport: Transport,
        policy: RestartPolicy,
        crew: Crew,
        journal: Journal,
        restarts: Restarts,
        notices: StopNotices,
        standbys: WarmStandbys,
    ) -> None:
        self.world = world
        self.console = console
        self.transport = transport
        self.policy = policy
        self.crew = crew
        self.journal = journal
        self.restarts = restarts
        self.notices = notices
        self.standbys = standbys
        journal.world(world.record())

    # ---- what an end means for the world ---------------------------------------------------------

    def lost(self, task: Task, event: TaskEvent) -> Decision | None:
        """A training task of this world that ended because its place's agent was lost, or
        with a follow-on error naming a peer on another machine that still runs as far as we
        know (its machine gone quiet: TensorFlow's coordination service noticed before the
        agent's silence did): the gang stops, that place is probed (None: not such an end)."""
        if event.returncode == 0 or not task.training:
            return None
        now = time.monotonic()
        why = self.world.lost_why(task.plan)
        if why is not None:
            return Decision(Action.RESIZE, self.world.suspect(task.plan, why, now))
        for name in event.lost_peers if event.peer_lost else ():
            peer = self.crew.tasks.get(name)
            if peer is not None and peer.alive and self.world.remote(peer.plan):
                why = f"{task.name}'s TensorFlow lost {name} (a follow-on error)"
                return Decision(Action.RESIZE, self.world.suspect(peer.plan, why, now))
        return None

    def held_out(self, task: Task, decision: Decision) -> Decision:
        """A FAIL with the restart budget spent (``decision``): the place of its cause is held
        out and the gang stops, the world decided without it; else ``decision`` as it was."""
        if not decision.spent:
            return decision
        cause = self.crew.tasks.get(decision.cause or task.name, task)
        line = self.world.hold_out(cause.plan, "restart budget exhausted", time.monotonic())
        if line is None:
            return decision
        return Decision(Action.RESIZE, f"{decision.reason}; {line}")

    def tick(self, now: float) -> Resize | None:
        """The world's turn: a place the transport says is lost stops the gang; then the
        membership policy's answer, if any."""
        self.world.transport_lost(now)
        if self.world.down:
            self.stop_gang()
        return self.world.tick(now)

    # ---- carrying out ----------------------------------------------------------------------------

    def apply(self, decision: Decision, unkeepable: str) -> None:
        """A RESIZE: stop the gang (no tasks: a loss), or go to the world decided, saving first
        while the gang trains (``unkeepable``: why a save cannot be asked for, "" when it can)."""
        if not decision.tasks:
            self.console.say(decision.reason)
            self.stop_gang()
            return
        answer = self.world.pending
        assert answer is not None
        running = [t for t in self.crew.alive() if t.training]
        if running and not unkeepable:
            notify = self.transport.notify  # type: ignore[attr-defined]  # unkeepable says so
            self.notices.send(signal.SIGTERM, self.restarts.attempt, notify, resize=answer.reason)
            return
        self.console.say(decision.reason)
        if running:
            self.console.say(f"cannot save first ({unkeepable}): from the latest checkpoint")
            self.stop_gang()
        self.start(answer)

    def after_save(self, saved: bool) -> None:
        """The save before a grow is over (``saved``: every training task saved): the new world
        starts, from what was saved (else from the latest checkpoint)."""
        answer = self.world.pending
        assert answer is not None
        step = self.notices.preemption().step if saved else None
        if not saved:
            self.console.say(
                "the save before the resize did not complete: from the latest checkpoint"
            )
        self.stop_gang()
        self.notices.ended()
        self.start(answer, step)

    def stop_gang(self) -> None:
        """Kill every training task still running (nothing of theirs is worth a grace)."""
        running = [t for t in self.crew.alive() if t.training]
        if running:
            self.crew.kill(running)

    def start(self, answer: Resize, step: int | None = None) -> None:
        """Restart the gang in the world of ``answer`` (every training task has ended), from
        ``step`` (saved before the resize; None: the latest checkpoint's, where the index says)."""
        from distlaunch.launcher.record import checkpoints

        change = self.world.started(answer, time.monotonic())
        plan = self.world.plan()
        self._adopt(plan)
        names = tuple(t.name for t in plan.tasks if t.role != contract.EVALUATOR)
        self.restarts.resize(plan, names)
        # Every training task has ended: a save the stop cut short is nobody's, and never resumed.
        folder = contract.checkpoint_dir(Path(plan.run_dir))
        removed = checkpoints.remove_cut_saves(folder)
        if removed:
            self.console.say(f"removed what saves cut short left: {', '.join(removed)}")
        index = checkpoints.resume_point(folder)
        if step is None and index is not None:
            step = index.step
        if answer.verdict is not Verdict.RESTART_SAME:
            self.journal.resized(
                self.restarts.attempt, self.world.record(), old=change.old, new=change.new,
                reason=change.reason, step=step, hosts=list(change.hosts),
            )  # fmt: skip
        if step is not None:
            at = f" from step {step}"
        elif any(folder.rglob(checkpoints.INDEX)):
            at = " from the latest checkpoint"  # a Keras backup: its index names no step
        else:
            at = " from the start (no checkpoint)"
        self.console.say(f"{self.world.text()} on {', '.join(change.hosts)}{at}")

    def _adopt(self, plan: Plan) -> None:
        """Every collaborator that knows the cluster learns the new one."""
        self.crew.adopt(plan)
        roles: dict[str, list[str]] = {}
        for task in plan.tasks:
            roles.setdefault(task.role, []).append(task.name)
        self.policy.cluster = Cluster(plan.strategy, roles)
        self.notices.savers = self.policy.cluster.savers()
        self.standbys.plan = plan
