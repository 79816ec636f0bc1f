"""The membership policy of an elastic run (launcher/run/membership.py), every branch with
scripted inputs: places lost, held out and back, the settle window, the interval, both budgets,
the cooldown that doubles, accepted sizes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distlaunch.launcher.plan.elastic import ElasticPlan, Slot
from distlaunch.launcher.run.membership import (
    MembershipPolicy,
    Place,
    Places,
    PlaceState,
    Situation,
    Verdict,
)

pytestmark = pytest.mark.quick

HOSTS = ("h1", "h2", "h3")
SLOTS = tuple(Slot(f"worker-{i}", h, h) for i, h in enumerate(HOSTS))
ALL = tuple(s.name for s in SLOTS)


def elastic(**fields) -> ElasticPlan:
    base = ElasticPlan(
        min_workers=2, max_workers=3, sizes=None, batch="global", slots=SLOTS,
        resizes=10, lost_after_s=10, settle_s=5, interval_s=30, cooldown_s=30,
        cooldown_max_s=100, probe_s=5,
    )  # fmt: skip
    return replace(base, **fields)


def decide(e, places, now, world=ALL, down=True, used=0, last=None):
    s = Situation(places.places, world, down, used, last)
    return MembershipPolicy(e).decide(now, s)


def test_a_lost_agent_is_probed_then_the_world_shrinks_after_the_settle_window():
    e = elastic()
    places = Places(HOSTS, e)
    places.suspect("h3", "agent lost", now=100)
    waiting = decide(e, places, now=101)
    assert waiting.verdict is Verdict.WAIT and waiting.wake_at == 110
    assert "elastic.lost_after_s" in waiting.reason
    assert places.expire(now=109) == []
    [line] = places.expire(now=111)
    assert "h3 lost: agent lost; no answer for 10 s; it may rejoin after 30 s" == line
    assert places["h3"].since == 110  # lost when its lost_after_s ran out
    settling = decide(e, places, now=112)
    assert settling.verdict is Verdict.WAIT and settling.wake_at == 115
    assert "elastic.settle_s" in settling.reason
    shrink = decide(e, places, now=115)
    assert shrink.verdict is Verdict.SHRINK
    assert shrink.slots == ("worker-0", "worker-1")
    assert shrink.reason.startswith("world 3 -> 2: h3 lost (agent lost")


def test_a_suspect_that_answers_restarts_the_same_world():
    e = elastic()
    places = Places(HOSTS, e)
    places.suspect("h2", "agent lost", now=0)
    places.answered("h2", True)
    assert places["h2"].state is PlaceState.UP
    again = decide(e, places, now=1)
    assert again.verdict is Verdict.RESTART_SAME and again.slots == ALL


def test_restarts_exhausted_hold_the_place_out_and_shrink():
    e = elastic()
    places = Places(HOSTS, e)
    places.hold_out("h2", "restart budget exhausted", now=0)
    assert places["h2"].state is PlaceState.HELD_OUT and places["h2"].until == 30
    shrink = decide(e, places, now=5)
    assert shrink.verdict is Verdict.SHRINK and shrink.slots == ("worker-0", "worker-2")
    assert "h2 held out (restart budget exhausted)" in shrink.reason


def test_below_the_minimum_fails_in_one_line_naming_the_lost_places():
    e = elastic()
    places = Places(HOSTS, e)
    places.lose("h2", "node DOWN", now=0)
    places.lose("h3", "agent lost", now=0)
    fail = decide(e, places, now=5, world=("worker-0", "worker-1"))
    assert fail.verdict is Verdict.FAIL
    assert "\n" not in fail.reason
    assert "1 usable worker slots, too few for a world of elastic.workers 2:3" in fail.reason
    assert "h2 lost (node DOWN)" in fail.reason and "h3 lost (agent lost)" in fail.reason


def test_the_resize_budget_is_its_own():
    e = elastic(resizes=1)
    places = Places(HOSTS, e)
    places.lose("h3", "agent lost", now=0)
    fail = decide(e, places, now=10, used=1)
    assert fail.verdict is Verdict.FAIL
    assert "resize budget exhausted (1 of 1, elastic.resizes)" in fail.reason
    assert decide(e, places, now=10, used=0).verdict is Verdict.SHRINK


def test_settle_is_skipped_when_every_place_is_back():
    e = elastic(cooldown_s=1)
    places = Places(HOSTS, e)
    places.lose("h3", "agent lost", now=100)
    places.answered("h3", True)
    grow = decide(e, places, now=101.5, world=("worker-0", "worker-1"))
    assert grow.verdict is Verdict.GROW and grow.slots == ALL


def test_a_place_back_grows_the_world_once_its_cooldown_and_the_interval_allow():
    e = elastic()
    places = Places(HOSTS, e)
    places.lose("h3", "agent lost", now=0)
    two = ("worker-0", "worker-1")
    assert decide(e, places, now=50, world=two, down=False).verdict is Verdict.STAY  # silent
    places.answered("h3", True)
    assert decide(e, places, now=20, world=two, down=False).verdict is Verdict.STAY  # cooling
    early = decide(e, places, now=40, world=two, down=False, last=20)
    assert early.verdict is Verdict.WAIT and early.wake_at == 50
    assert "elastic.interval_s" in early.reason
    grow = decide(e, places, now=50, world=two, down=False, last=20)
    assert grow.verdict is Verdict.GROW and grow.slots == ALL
    assert grow.reason == "world 2 -> 3: h3 answers again"
    spent = decide(e, places, now=50, world=two, down=False, used=10)
    assert spent.verdict is Verdict.STAY and "resize budget spent" in spent.reason
    places.rejoined(["h3"])
    assert places["h3"] == Place(PlaceState.UP, 0, 1, 30, False, "")


def test_a_full_world_never_grows():
    e = elastic()
    places = Places(HOSTS, e)
    assert decide(e, places, now=0, down=False).verdict is Verdict.STAY


def test_the_cooldown_doubles_for_a_place_that_flaps_and_a_line_says_so():
    e = elastic()
    places = Places(HOSTS, e)
    first = places.lose("h3", "agent lost", now=0)
    assert "after 30 s" in first and "doubles" not in first
    places.rejoined(["h3"])
    second = places.hold_out("h3", "restart budget exhausted", now=100)
    assert "after 60 s" in second and "failure 2" in second and "doubles" in second
    places.rejoined(["h3"])
    third = places.lose("h3", "agent lost", now=200)
    assert "after 100 s" in third  # cooldown_max_s
    assert places["h3"].until == 300


def test_sizes_the_program_accepts():
    e = elastic(min_workers=1, max_workers=3, sizes=(1, 3))
    places = Places(HOSTS, e)
    places.lose("h3", "agent lost", now=0)
    shrink = decide(e, places, now=10)
    assert shrink.verdict is Verdict.SHRINK and shrink.slots == ("worker-0",)
    none = elastic(sizes=(3,))
    places = Places(HOSTS, none)
    places.lose("h3", "agent lost", now=0)
    fail = decide(none, places, now=10)
    assert fail.verdict is Verdict.FAIL and "in elastic.sizes [3]" in fail.reason


def test_a_local_run_holds_out_one_slot_of_its_one_host():
    slots = tuple(Slot(f"worker-{i}", "localhost", f"worker-{i}@localhost") for i in range(3))
    e = elastic(slots=slots)
    places = Places((s.place for s in slots), e)
    places.hold_out("worker-2@localhost", "restart budget exhausted", now=0)
    shrink = decide(e, places, now=5)
    assert shrink.verdict is Verdict.SHRINK and shrink.slots == ("worker-0", "worker-1")


def test_a_suspect_while_training_does_not_wait():
    # The world was not stopped (the loss was a place outside it): nothing to wait for.
    e = elastic()
    places = Places(HOSTS, e)
    places.lose("h3", "agent lost", now=0)
    places.suspect("h2", "agent lost", now=1)
    assert places["h3"].state is PlaceState.LOST  # suspect() changes only an up place
    stay = decide(e, places, now=2, world=("worker-0", "worker-1"), down=False)
    assert stay.verdict is Verdict.STAY
