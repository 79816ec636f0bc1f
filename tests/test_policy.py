"""The restart policy's decisions, driven by scripted events (no processes needed)."""

from __future__ import annotations

import pytest

from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.run.policy import (
    Action,
    Cluster,
    History,
    RestartPolicy,
    RestartRules,
    TaskEvent,
)

pytestmark = pytest.mark.quick

MWMS = Cluster("multi_worker_mirrored", {"worker": ["worker-0", "worker-1"]})
PSS = Cluster(
    "parameter_server",
    {
        "chief": ["chief-0"],
        "worker": ["worker-0", "worker-1"],
        "ps": ["ps-0"],
        "evaluator": ["evaluator-0"],
    },
)
ON_FAILURE = RestartRules(policy="on-failure", max_restarts=3, initial_backoff_s=1, max_backoff_s=3)


def decide(cluster, rules, name, code, error_type=None, exited=None, restarts=(), now=100.0):
    role = name.rsplit("-", 1)[0]
    return RestartPolicy(cluster, rules).decide(
        TaskEvent(name, role, code, error_type),
        exited or {name: code},
        History(tuple(restarts)),
        now,
    )


def test_never_fails_on_the_first_failure():
    d = decide(MWMS, RestartRules(), "worker-1", -9)
    assert d.action is Action.FAIL and "was killed by signal SIGKILL" in d.reason


def test_mwms_failure_restarts_the_whole_gang():
    d = decide(MWMS, ON_FAILURE, "worker-1", -9)
    assert d.action is Action.RESTART and d.tasks == ("worker-0", "worker-1")


def test_mwms_done_when_every_worker_exited_zero():
    assert decide(MWMS, ON_FAILURE, "worker-0", 0, exited={"worker-0": 0}).action is Action.CONTINUE
    assert (
        decide(MWMS, ON_FAILURE, "worker-1", 0, exited={"worker-0": 0, "worker-1": 0}).action
        is Action.DONE
    )


@pytest.mark.parametrize(
    "name,expected",
    [
        ("worker-1", ("worker-1",)),
        ("ps-0", ("ps-0", "chief-0")),
        ("chief-0", ("chief-0",)),
        ("evaluator-0", ("evaluator-0",)),
    ],
)
def test_pss_restart_sets(name, expected):
    d = decide(PSS, ON_FAILURE, name, 1)
    assert d.action is Action.RESTART and d.tasks == expected


def test_pss_server_exiting_zero_is_a_failure_and_chief_zero_is_done():
    assert decide(PSS, ON_FAILURE, "ps-0", 0).action is Action.RESTART
    assert decide(PSS, RestartRules(), "worker-0", 0).action is Action.FAIL
    assert decide(PSS, ON_FAILURE, "chief-0", 0).action is Action.DONE
    assert decide(PSS, ON_FAILURE, "evaluator-0", 0).action is Action.CONTINUE


def test_non_retryable_exit_codes_and_errors():
    d = decide(MWMS, ON_FAILURE, "worker-0", 2)
    assert d.action is Action.FAIL and "not retried" in d.reason
    d = decide(MWMS, ON_FAILURE, "worker-0", 1, error_type="ModuleNotFoundError")
    assert d.action is Action.FAIL and "ModuleNotFoundError" in d.reason
    assert (
        decide(MWMS, ON_FAILURE, "worker-0", 1, error_type="RuntimeError").action is Action.RESTART
    )


def test_budget_is_honored_and_backoff_grows():
    delays = [
        decide(MWMS, ON_FAILURE, "worker-0", 1, restarts=[90.0] * n).delay_s for n in range(3)
    ]
    assert delays == [1, 2, 3]  # doubles, capped at max_s
    d = decide(MWMS, ON_FAILURE, "worker-0", 1, restarts=[90.0, 91.0, 92.0])
    assert d.action is Action.FAIL and "restart budget exhausted (3 of 3" in d.reason


def test_window_forgets_old_restarts():
    rules = RestartRules(policy="on-failure", max_restarts=1, window_s=10)
    assert decide(MWMS, rules, "worker-0", 1, restarts=[50.0], now=100.0).action is Action.RESTART
    assert decide(MWMS, rules, "worker-0", 1, restarts=[95.0], now=100.0).action is Action.FAIL


def test_manual_restart_uses_the_same_sets_and_no_budget():
    policy = RestartPolicy(PSS, RestartRules())
    d = policy.decide(
        TaskEvent("ps-0", "ps", None, kind=EventKind.MANUAL), {}, History((1.0,) * 10), 100.0
    )
    assert d.action is Action.RESTART and d.tasks == ("ps-0", "chief-0")


def test_hang_counts_as_failure():
    d = RestartPolicy(MWMS, ON_FAILURE).decide(
        TaskEvent("worker-1", "worker", None, kind=EventKind.HUNG), {}, History(), 0.0
    )
    assert d.action is Action.RESTART and "stopped making progress" in d.reason


def test_backoff_stays_at_its_cap_after_thousands_of_restarts():
    # 2 ** 1024 does not fit a float: the delay must stay max_s, not raise OverflowError.
    rules = RestartRules(
        policy="on-failure", max_restarts=5000, initial_backoff_s=1.0, max_backoff_s=30.0
    )
    d = decide(MWMS, rules, "worker-1", 1, restarts=[99.0] * 2000)
    assert d.action is Action.RESTART and d.delay_s == 30


def test_the_same_traceback_twice_is_a_crash_loop():
    policy = RestartPolicy(MWMS, ON_FAILURE)
    first = TaskEvent("worker-0", "worker", 1, "ValueError", fingerprint="ValueError\nbad N")
    assert policy.decide(first, {"worker-0": 1}, History(), 100.0).action is Action.RESTART
    again = policy.decide(
        first, {"worker-0": 1}, History((99.0,), last_fingerprint="ValueError\nbad N"), 100.0
    )
    assert again.action is Action.FAIL and again.crash_loop and again.cause == "worker-0"
    other = TaskEvent("worker-0", "worker", 1, "KeyError", fingerprint="KeyError\nx")
    d = policy.decide(
        other, {"worker-0": 1}, History((99.0,), last_fingerprint="ValueError\nbad N"), 100.0
    )
    assert d.action is Action.RESTART


def test_a_survivor_that_lost_its_peer_is_never_the_cause():
    policy = RestartPolicy(MWMS, RestartRules())
    # worker-1 died first (SIGKILL); worker-0's UnavailableError followed.
    survivor = TaskEvent("worker-0", "worker", 1, "UnavailableError", peer_lost=True)
    d = policy.decide(survivor, {"worker-1": -9, "worker-0": 1}, History(), 100.0)
    assert d.action is Action.FAIL and d.cause == "worker-1"
    # Nobody else has failed: no cause is named rather than the survivor.
    d = policy.decide(survivor, {"worker-0": 1}, History(), 100.0)
    assert d.action is Action.FAIL and d.cause is None
    # Another follow-on error is not a cause either.
    d = policy.decide(
        survivor, {"worker-1": 1, "worker-0": 1}, History(peer_lost=frozenset({"worker-1"})), 100.0
    )
    assert d.cause is None


def test_a_task_named_lost_by_the_survivors_error_is_the_cause():
    survivor = TaskEvent(
        "worker-0", "worker", 1, "UnavailableError", peer_lost=True, lost_peers=("worker-1",)
    )
    d = RestartPolicy(MWMS, RestartRules()).decide(survivor, {"worker-0": 1}, History(), 100.0)
    assert d.action is Action.FAIL and d.cause == "worker-1"


@pytest.mark.parametrize(
    "kind", [EventKind.STARTUP_TIMEOUT, EventKind.FORMATION, EventKind.RUN_TIMEOUT]
)
def test_a_deadline_fails_the_run_whatever_the_budget(kind):
    # The limits set for the whole run: restarting cannot make the run meet them.
    event = TaskEvent("worker-1", "worker", None, kind=kind, detail="missed its deadline")
    d = RestartPolicy(MWMS, ON_FAILURE).decide(event, {}, History(), 0.0)
    assert d.action is Action.FAIL and d.cause == "worker-1" and d.note == ""
    assert d.reason == "worker-1 missed its deadline"


def test_the_end_of_the_evaluators_drain_ends_the_run_as_done():
    for code in (None, 0, 1):  # its drain time ran out; it finished; it failed after training
        event = TaskEvent("evaluator-0", "evaluator", code, kind=EventKind.DRAINED, detail="why")
        d = RestartPolicy(PSS, ON_FAILURE).decide(event, {}, History(), 0.0)
        assert d.action is Action.DONE and d.reason == "why"


# ---- stop notices: every way one meets a run is an event decided here (issue 36) ----------


def notice(history: History, cluster=MWMS) -> Action:
    event = TaskEvent("run", "", None, kind=EventKind.NOTICE, detail="SIGTERM")
    return RestartPolicy(cluster, ON_FAILURE).decide(event, {}, history, 0.0).action


def test_a_first_notice_is_sent_a_second_joins_it_a_third_stops_at_once():
    assert notice(History()) is Action.NOTIFY
    assert notice(History(notices=1)) is Action.CONTINUE  # `down` twice: the same save
    assert notice(History(notices=2)) is Action.STOP


def test_a_notice_after_training_is_done_ends_the_run_as_done():
    assert notice(History(training_done=True)) is Action.DONE


def test_a_notice_that_cannot_be_kept_stops_at_once():
    assert notice(History(unkeepable="the program cannot save on a stop notice")) is Action.STOP


def after_notice(exits: dict[str, int], cluster=MWMS, history=History()) -> Action:
    """Feed the exits after a notice one by one; the last decision."""
    exited: dict[str, int] = {}
    action = Action.CONTINUE
    for name, code in exits.items():
        exited[name] = code
        event = TaskEvent(name, name.rsplit("-", 1)[0], code, kind=EventKind.PREEMPTED)
        action = RestartPolicy(cluster, ON_FAILURE).decide(event, exited, history, 0.0).action
    return action


@pytest.mark.parametrize("saved", [75, 42, 143])
@pytest.mark.parametrize("first", ["finished", "saved"])
def test_a_mix_of_finished_and_saved_after_a_notice_ends_preempted(saved, first):
    # One rank was in its last step and finished, the other saved: both ended well.
    exits = {"worker-0": 0, "worker-1": saved}
    if first == "saved":
        exits = {"worker-1": saved, "worker-0": 0}
    assert after_notice(exits) is Action.PREEMPTED


def test_after_a_notice_every_task_finished_or_training_was_done_is_done():
    assert after_notice({"worker-0": 0, "worker-1": 0}) is Action.DONE
    done = History(training_done=True)
    assert after_notice({"worker-0": 0, "worker-1": 75}, history=done) is Action.DONE
    assert after_notice({"worker-0": 75, "worker-1": 1}) is Action.STOP


def test_after_a_notice_the_pss_chief_decides():
    assert after_notice({"worker-0": 75}, PSS) is Action.CONTINUE
    assert after_notice({"chief-0": 0}, PSS) is Action.DONE
    assert after_notice({"chief-0": 75}, PSS) is Action.PREEMPTED


def test_a_save_deadline_with_a_notice_still_held_ends_preempted():
    # A task never took the notice (still starting): no step of the attempt ran.
    event = TaskEvent("worker-0", "worker", None, kind=EventKind.SAVE_TIMEOUT, detail="late")
    policy = RestartPolicy(MWMS, ON_FAILURE)
    held = History(held=frozenset({"worker-1"}))
    assert policy.decide(event, {}, held, 0.0).action is Action.PREEMPTED
    assert policy.decide(event, {}, History(), 0.0).action is Action.STOP
