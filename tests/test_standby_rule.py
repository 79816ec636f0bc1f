"""The rule both warm-standby pools keep (launcher/transports/standby_rule.py), as a pure
decision: no process is started."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.transports.standby_rule import Held, Reconcile, reconcile

pytestmark = pytest.mark.quick


def _task(name: str, attempt: int = 1, transport: TaskTransport = TaskTransport.SSH) -> TaskPlan:
    role, index = name.split("-")
    plan = TaskPlan(role, int(index), "h", 2222, (), {}, "", {}, (), "", transport=transport)
    return replace(plan, attempt=attempt)


def test_a_live_standby_of_the_wanted_plan_is_kept_and_others_are_replaced_or_dropped() -> None:
    held = {
        "worker-0": Held(_task("worker-0"), alive=True),  # made for this plan: kept
        "worker-1": Held(_task("worker-1", attempt=0), alive=True),  # stale: replaced
        "worker-2": Held(_task("worker-2"), alive=False),  # died: cold from now on
        "worker-3": Held(_task("worker-3"), alive=True),  # no longer wanted: dropped
    }
    tasks = [_task(f"worker-{i}") for i in (2, 1, 0, 4, 5)] + [
        _task("chief-0", transport=TaskTransport.LOCAL),  # another pool's task
    ]
    step = reconcile(held, tasks, TaskTransport.SSH, cold={"worker-5"})
    assert step == Reconcile(
        discard=("worker-1", "worker-2", "worker-3"),
        died=frozenset({"worker-2"}),
        start=(_task("worker-1"), _task("worker-4")),  # in the order the tasks were named
    )


def test_a_standby_that_died_makes_its_task_cold_even_when_it_is_no_longer_wanted() -> None:
    held = {"ps-0": Held(_task("ps-0"), alive=False)}
    assert reconcile(held, [], TaskTransport.SSH, cold=set()) == Reconcile(
        discard=("ps-0",), died=frozenset({"ps-0"}), start=()
    )


def test_an_empty_pool_starts_a_standby_for_each_task_of_its_kind() -> None:
    tasks = [_task("worker-0", transport=TaskTransport.LOCAL), _task("worker-1")]
    step = reconcile({}, tasks, TaskTransport.LOCAL, cold=set())
    assert step == Reconcile(discard=(), died=frozenset(), start=(tasks[0],))
