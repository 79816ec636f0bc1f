"""An elastic run's world as the loop holds it: which slots train now, the places' states fed by
probes, and the membership policy's answers.

The loop never waits here. Probes (the transport's `probe`, a short ssh or a Slurm query) run in
threads of their own; each `tick` collects the answers that came, starts the probes that are due
(a suspect place every SUSPECT_PROBE_S, a lost or held-out one every elastic.probe_s), turns the
suspects that stayed silent for elastic.lost_after_s into lost places, and asks the policy
(`membership.MembershipPolicy`) once its last WAIT is out. What an answer means for the tasks
(the gang stopped, a save first, a restart in another world) is `events.Events`'s; this object
keeps the facts and makes the plan of the world it names (`plan.world.world_plan`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distlaunch.launcher.plan.plan import Plan, TaskPlan
from distlaunch.launcher.plan.world import world_plan
from distlaunch.launcher.run.membership import (
    MembershipPolicy,
    Places,
    PlaceState,
    Resize,
    Situation,
    Verdict,
)
from distlaunch.worker import contract

if TYPE_CHECKING:
    # Imported where the first probe starts: `up` must not load it before its first task
    # (tests/test_cli.py, bench/startup.py), and most runs never probe.
    from concurrent.futures import Future, ThreadPoolExecutor

# How often a suspect place (its agent just lost) is probed while lost_after_s runs.
SUSPECT_PROBE_S = 1.0
# At most this many probes at once (each mostly waits on a connection).
PROBE_THREADS = 4


@dataclass(frozen=True)
class WorldChange:
    """A world that started: its size before and now, why, and the hosts of the new one."""

    old: int
    new: int
    reason: str
    hosts: tuple[str, ...]


class World:
    """The slots of an elastic run's current world, its places and its resizes."""

    def __init__(self, full: Plan, transport: Any, say: Callable[[str], None]) -> None:
        assert full.elastic is not None
        self.full = full
        self.elastic = full.elastic
        self.slots = self.elastic.first_world()
        self.places = Places(dict.fromkeys(s.place for s in self.elastic.slots), self.elastic)
        self.policy = MembershipPolicy(self.elastic)
        self.say = say
        self.down = False  # the gang is stopped: the world must be decided before it restarts
        self.cause = ""  # the task whose loss or failure stopped the gang
        self.pending: Resize | None = None  # a resize decided, waiting for its save
        self.resizes = 0
        self.last_resize: float | None = None
        self.worlds = [len(self.slots)]
        self._wake = 0.0  # the policy is asked again from then on
        self._probe: Callable[[str], bool] | None = getattr(transport, "probe", None)
        self._lost_hosts: Callable[[], Mapping[str, str]] | None = getattr(
            transport, "lost_hosts", None
        )
        self._seen_lost: Mapping[str, str] = {}  # what `transport_lost` saw last
        self._pool: ThreadPoolExecutor | None = None
        self._probing: dict[str, Future[bool]] = {}
        self._next_probe: dict[str, float] = {}

    # ---- the world's plan ---------------------------------------------------------------------

    def plan(self) -> Plan:
        """The plan of the current world (attempt as the full plan's; `Restarts` moves it on)."""
        return world_plan(self.full, self.slots)

    def place_of(self, task: TaskPlan) -> str | None:
        """The place of a worker of the current world (None: not a worker)."""
        if task.role != contract.WORKER or task.index >= len(self.slots):
            return None
        return self.elastic.slot(self.slots[task.index]).place

    def hosts(self, slots: tuple[str, ...] | None = None) -> tuple[str, ...]:
        """The hosts of a world's slots (the current one's by default), in slot order."""
        names = self.slots if slots is None else slots
        return tuple(dict.fromkeys(self.elastic.slot(n).host for n in names))

    def text(self) -> str:
        """``world 2 of 2:3``."""
        return f"world {len(self.slots)} of {self.elastic.range_text}"

    def record(self) -> dict:
        """run.json's ``world``: the range, the size, which slot each task holds, the worlds."""
        return {
            "workers": self.elastic.range_text,
            "size": len(self.slots),
            "slots": {f"worker-{i}": slot for i, slot in enumerate(self.slots)},
            "hosts": list(self.hosts()),
            "out": {n: self.places[n].state.value for n in self.places.out()},
            "worlds": list(self.worlds),
            "resizes": self.resizes,
        }

    # ---- what the run learns -------------------------------------------------------------------

    def lost_why(self, task: TaskPlan) -> str | None:
        """Why the place of ``task`` (a worker of this world) is lost, as its transport says
        (`transports.base.ResizeTransport.lost_hosts`); None when it is not."""
        if self.place_of(task) is None or self._lost_hosts is None:
            return None
        return self._lost_hosts().get(self.elastic.slot(self.slots[task.index]).host)

    def remote(self, task: TaskPlan) -> bool:
        """Whether ``task`` is a worker of this world on a machine of its own (a place that is
        a host, which can be lost, not a slot of this machine)."""
        place = self.place_of(task)
        return place is not None and not self._is_slot(place)

    def suspect(self, task: TaskPlan, why: str, now: float) -> str:
        """``task``'s place seems gone (``why``: its agent was lost, its peers lost it): the
        gang is down, the place is probed; the line that says so."""
        place = self.place_of(task)
        assert place is not None
        self.places.suspect(place, why, now)
        self._stopped(task)
        self._next_probe[place] = now
        lost_after = self.elastic.lost_after_s
        return (
            f"{place} ({task.name}): {why}; stopping the gang and probing {place} for up to "
            f"{lost_after:g} s (elastic.lost_after_s)"
        )

    def hold_out(self, task: TaskPlan, why: str, now: float) -> str | None:
        """``task``'s restarts are exhausted: its place is held out, the gang is down; the line
        that says so (None: not a worker of this world, nothing is held out)."""
        place = self.place_of(task)
        if place is None:
            return None
        self._stopped(task)
        return self.places.hold_out(place, why, now)

    def _stopped(self, task: TaskPlan) -> None:
        self.down = True
        self.cause = task.name
        self.pending = None
        self._wake = 0.0

    def transport_lost(self, now: float) -> list[str]:
        """The world's places that the transport says are lost since it was last asked (a
        Slurm node DOWN); each becomes a suspect, probed (the caller stops the gang). A loss is
        acted on once: a lost SSH agent stays reported until a task starts there again."""
        if self._lost_hosts is None:
            return []
        lost, seen = dict(self._lost_hosts()), self._seen_lost
        self._seen_lost = lost
        found = []
        for i, name in enumerate(self.slots):
            slot = self.elastic.slot(name)
            why = lost.get(slot.host)
            new = why is not None and seen.get(slot.host) != why
            if new and self.places[slot.place].state is PlaceState.UP:
                self.places.suspect(slot.place, why, now)
                self._next_probe[slot.place] = now
                found.append(f"worker-{i}")
        if found:
            self.down, self.cause, self.pending, self._wake = True, found[0], None, 0.0
        return found

    # ---- the loop's turn -----------------------------------------------------------------------

    def tick(self, now: float) -> Resize | None:
        """Collect probes, start those due, expire silent suspects; the policy's answer when it
        is time to ask and it is no WAIT or STAY (None otherwise)."""
        self._collect()
        self._start_probes(now)
        for line in self.places.expire(now):
            self.say(line)
            self._wake = 0.0
        if self.pending is not None or now < self._wake:
            return None
        situation = Situation(
            self.places.places, self.slots, self.down, self.resizes, self.last_resize
        )
        answer = self.policy.decide(now, situation)
        if answer.verdict is Verdict.WAIT:
            self._wake = answer.wake_at if answer.wake_at is not None else now + 1.0
            return None
        if answer.verdict is Verdict.STAY:
            self._wake = now + min(self.elastic.probe_s, 1.0)
            return None
        return answer

    def started(self, answer: Resize, now: float) -> WorldChange:
        """The world of ``answer`` starts: its places are up; a resize counts."""
        old = len(self.slots)
        self.slots = answer.slots
        self.places.rejoined(self.elastic.slot(n).place for n in answer.slots)
        self.down, self.pending, self._wake = False, None, 0.0
        if answer.verdict in (Verdict.SHRINK, Verdict.GROW):
            self.resizes += 1
            self.last_resize = now
            self.worlds.append(len(answer.slots))
        return WorldChange(old, len(answer.slots), answer.reason, self.hosts())

    def resumed(self) -> None:
        """The gang restarts in the same world (an ordinary restart)."""
        self.down, self._wake = False, 0.0

    # ---- probes ----------------------------------------------------------------------------

    def _start_probes(self, now: float) -> None:
        for name in self.places.out():
            if name in self._probing or now < self._next_probe.get(name, 0.0):
                continue
            suspect = self.places[name].state is PlaceState.SUSPECT
            self._next_probe[name] = now + (SUSPECT_PROBE_S if suspect else self.elastic.probe_s)
            if self._is_slot(name):
                self.places.answered(name, True)  # a slot of this machine: it is there
                continue
            if self._probe is None:
                continue  # a transport that cannot probe: a lost host never comes back
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="probe")
            host = next(s.host for s in self.elastic.slots if s.place == name)
            self._probing[name] = self._pool.submit(_probe, self._probe, host)

    def _is_slot(self, place: str) -> bool:
        return any(s.place == place and s.place != s.host for s in self.elastic.slots)

    def _collect(self) -> None:
        for name, future in list(self._probing.items()):
            if future.done():
                del self._probing[name]
                self.places.answered(name, future.result())

    def close(self) -> None:
        """No more probes: the run is over (one under way ends within its own timeout)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _probe(probe: Callable[[str], bool], host: str) -> bool:
    """One probe; an error in it is a host that does not answer."""
    try:
        return bool(probe(host))
    except Exception:  # noqa: BLE001 - a probe that fails is a host that does not answer
        return False
