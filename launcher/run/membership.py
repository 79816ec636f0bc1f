"""Who may train in an elastic run, and when its world changes: pure objects, the clock passed in.

`Places` keeps the state of each place a worker slot can be lost from (`elastic.Slot.place`: a
host, or a slot of this machine) and the transitions between states; `MembershipPolicy.decide`
reads them with the world, the budgets and the clock and answers a `Resize`: WAIT (and when to
ask again), STAY, RESTART_SAME, SHRINK or GROW (to which slots), or FAIL (why, in one line).
Nothing here touches a process, a thread or a probe (launcher/run/elastic.py does, and feeds
the answers in), so scripted inputs test every branch.

A place's states:

    up -> suspect        its agent was lost: it is probed for elastic.lost_after_s
    suspect -> up        it answered: the world restarts as it was (the restart budget)
    suspect -> lost      it did not answer within lost_after_s (or the transport says it is lost)
    up -> held out       the restarts were exhausted there (restart.max_restarts)
    lost|held out -> up  it answers again, its cooldown is over, and a world that holds it starts

Each loss or hold-out is a failure of the place: it may not rejoin for elastic.cooldown_s,
doubled at each failure up to cooldown_max_s (Horovod's blacklist cooldown), and a line says so
from the second failure on: a place that flaps waits longer each time.

The budgets: a restart of the same world is an ordinary restart (restart.max_restarts); a change
of the world is a resize (elastic.resizes). A world broken by a loss is resized after the settle
window (elastic.settle_s: more news may come), unless every place is back; it is never made to
wait for the interval, since it cannot go on. A grow (a place back while training) waits for the
interval since the latest resize (elastic.interval_s) and needs a resize left in the budget.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from distlaunch.launcher.plan.elastic import ElasticPlan


class PlaceState(enum.StrEnum):
    """Where a place stands (see the module docstring)."""

    UP = "up"
    SUSPECT = "suspect"
    LOST = "lost"
    HELD_OUT = "held out"


@dataclass(frozen=True)
class Place:
    """One place's state: since when, its failures so far, until when it is held out, whether
    its latest probe answered, and why it left."""

    state: PlaceState = PlaceState.UP
    since: float = 0.0
    failures: int = 0
    until: float = 0.0
    answers: bool = False
    why: str = ""

    def usable(self, now: float) -> bool:
        """Whether a world may hold it now: up, or back (answering) with its cooldown over."""
        if self.state is PlaceState.UP:
            return True
        out = self.state in (PlaceState.LOST, PlaceState.HELD_OUT)
        return out and self.answers and now >= self.until


class Places:
    """Every place's state, changed by what the run learns (the clock passed in)."""

    def __init__(self, names: Iterable[str], elastic: ElasticPlan) -> None:
        self.elastic = elastic
        self.places = {name: Place() for name in names}

    def __getitem__(self, name: str) -> Place:
        return self.places[name]

    def suspect(self, name: str, why: str, now: float) -> None:
        """Its agent was lost: probe it for lost_after_s."""
        if self.places[name].state is PlaceState.UP:
            self.places[name] = replace(
                self.places[name], state=PlaceState.SUSPECT, since=now, why=why
            )

    def answered(self, name: str, answers: bool) -> None:
        """Its latest probe answered (or not)."""
        place = self.places[name]
        if place.state is PlaceState.SUSPECT and answers:
            self.places[name] = replace(place, state=PlaceState.UP, why="")
        elif place.state is not PlaceState.UP:
            self.places[name] = replace(place, answers=answers)

    def expire(self, now: float) -> list[str]:
        """The suspects that did not answer within lost_after_s are lost; a line for each."""
        lines = []
        for name, place in self.places.items():
            due = place.since + self.elastic.lost_after_s
            if place.state is PlaceState.SUSPECT and now >= due:
                why = f"{place.why}; no answer for {self.elastic.lost_after_s:g} s"
                lines.append(self.lose(name, why, due))
        return lines

    def lose(self, name: str, why: str, now: float) -> str:
        """It is lost (no answer, or its transport says so); the line that says so."""
        return self._fail(name, PlaceState.LOST, why, now)

    def hold_out(self, name: str, why: str, now: float) -> str:
        """Its restarts are exhausted: held out; the line that says so."""
        return self._fail(name, PlaceState.HELD_OUT, why, now)

    def _fail(self, name: str, state: PlaceState, why: str, now: float) -> str:
        place = self.places[name]
        failures = place.failures + 1
        e = self.elastic
        cooldown = min(e.cooldown_s * 2.0 ** min(failures - 1, 64), e.cooldown_max_s)
        self.places[name] = Place(state, now, failures, now + cooldown, False, why)
        line = f"{name} {state.value}: {why}; it may rejoin after {cooldown:g} s"
        if failures > 1:
            line += (
                f" (failure {failures}: the cooldown doubles at each, elastic.cooldown_s "
                f"{e.cooldown_s:g} s up to cooldown_max_s {e.cooldown_max_s:g} s)"
            )
        return line

    def rejoined(self, names: Iterable[str]) -> None:
        """A world that holds these places started: they are up (their failures are kept)."""
        for name in names:
            place = self.places[name]
            if place.state is not PlaceState.UP:
                self.places[name] = replace(place, state=PlaceState.UP, answers=False, why="")

    def out(self) -> list[str]:
        """The places that are not up, in order."""
        return [n for n, p in self.places.items() if p.state is not PlaceState.UP]


class Verdict(enum.StrEnum):
    """What the membership policy answers."""

    WAIT = "wait"  # nothing yet: ask again at `Resize.wake_at`
    STAY = "stay"  # the world trains on as it is
    RESTART_SAME = "restart same"  # the gang restarts in the same world (the restart budget)
    SHRINK = "shrink"  # the gang restarts in a smaller world (or other slots of the same size)
    GROW = "grow"  # the gang restarts in a bigger world (while training: after a save)
    FAIL = "fail"  # the run cannot go on: too few places, or the resize budget is spent


@dataclass(frozen=True)
class Resize:
    """The policy's answer: a verdict, the slots of the world to start (SHRINK, GROW,
    RESTART_SAME), why (one line, logged), and for WAIT when to ask again."""

    verdict: Verdict
    reason: str
    slots: tuple[str, ...] = ()
    wake_at: float | None = None


@dataclass(frozen=True)
class Situation:
    """What the policy decides on besides the places: the world (its slots), whether its gang
    is stopped and must restart (``down``), the resizes so far and when the latest was."""

    places: Mapping[str, Place]
    world: tuple[str, ...]
    down: bool
    resizes_used: int = 0
    last_resize: float | None = None


class MembershipPolicy:
    """Decides an elastic run's world (see the module docstring)."""

    def __init__(self, elastic: ElasticPlan) -> None:
        self.elastic = elastic

    def decide(self, now: float, s: Situation) -> Resize:
        """The world to run after what ``s`` says, at ``now``."""
        e = self.elastic
        suspects = [n for n, p in s.places.items() if p.state is PlaceState.SUSPECT]
        if s.down and suspects:
            wake = min(s.places[n].since for n in suspects) + e.lost_after_s
            why = f"probing {', '.join(suspects)} for up to {e.lost_after_s:g} s (elastic.lost_after_s)"
            return Resize(Verdict.WAIT, why, wake_at=wake)
        usable = [slot for slot in e.slots if s.places[slot.place].usable(now)]
        size = e.best_size(len(usable))
        chosen = tuple(slot.name for slot in usable[:size]) if size else ()
        if not s.down:
            return self._grow(now, s, chosen)
        losses = [p.since for p in s.places.values() if p.state is not PlaceState.UP]
        settle_until = max(losses, default=now) + e.settle_s
        if now < settle_until and len(usable) < len(e.slots):
            why = f"waiting {e.settle_s:g} s (elastic.settle_s) for more news before resizing"
            return Resize(Verdict.WAIT, why, wake_at=settle_until)
        if size is None:
            return Resize(Verdict.FAIL, self._too_few(s, len(usable)))
        if chosen == s.world:
            return Resize(Verdict.RESTART_SAME, f"world {len(chosen)} again", chosen)
        if s.resizes_used >= e.resizes:
            why = f"{self._news(s, now)}; resize budget exhausted ({s.resizes_used} of {e.resizes}, elastic.resizes)"
            return Resize(Verdict.FAIL, why)
        verdict = Verdict.GROW if len(chosen) > len(s.world) else Verdict.SHRINK
        return Resize(verdict, self._change(s, chosen, now), chosen)

    def _grow(self, now: float, s: Situation, chosen: tuple[str, ...]) -> Resize:
        """While the world trains: a bigger world if places are back and the rules allow."""
        e = self.elastic
        if len(chosen) <= len(s.world):
            return Resize(Verdict.STAY, f"world {len(s.world)}")
        if s.resizes_used >= e.resizes:
            why = f"resize budget spent ({e.resizes}, elastic.resizes): staying at {len(s.world)}"
            return Resize(Verdict.STAY, why)
        if s.last_resize is not None and now < s.last_resize + e.interval_s:
            why = f"at most one resize per {e.interval_s:g} s (elastic.interval_s)"
            return Resize(Verdict.WAIT, why, wake_at=s.last_resize + e.interval_s)
        return Resize(Verdict.GROW, self._change(s, chosen, now), chosen)

    def _change(self, s: Situation, chosen: tuple[str, ...], now: float) -> str:
        return f"world {len(s.world)} -> {len(chosen)}: {self._news(s, now)}"

    def _news(self, s: Situation, now: float) -> str:
        """What changed: the places out, and those back."""
        back = [n for n, p in s.places.items() if p.state is not PlaceState.UP and p.usable(now)]
        out = [f"{n} {p.state.value} ({p.why})" for n, p in s.places.items() if not p.usable(now)]
        parts = [*out, *(f"{n} answers again" for n in back)]
        return "; ".join(parts) or "the slots changed"

    def _too_few(self, s: Situation, usable: int) -> str:
        e = self.elastic
        sizes = f" in elastic.sizes {list(e.sizes)}" if e.sizes is not None else ""
        out = [
            f"{n} {p.state.value} ({p.why})"
            for n, p in s.places.items()
            if p.state is not PlaceState.UP
        ]
        return (
            f"{usable} usable worker slots, too few for a world of elastic.workers "
            f"{e.range_text}{sizes}: {'; '.join(out)}"
        )
