"""The plan of a world of an elastic run (launcher/plan/world.py): a pure function of the full
plan and the chosen worker slots."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

import pytest

from conftest import write_spec
from distlaunch.launcher.plan import elastic as slots
from distlaunch.launcher.plan import world
from distlaunch.launcher.plan.placement import on_hosts
from distlaunch.launcher.plan.plan import make_plan
from distlaunch.launcher.spec.model import load_spec
from distlaunch.worker import contract

pytestmark = pytest.mark.quick


@dataclass(frozen=True)
class Elastic:
    """The spec's typed elastic section, as slots.elastic_plan reads it."""

    min_workers: int = 2
    max_workers: int = 3
    sizes: tuple[int, ...] | None = None
    batch: str = "global"
    resizes: int = 10
    lost_after_s: float = 10.0
    settle_s: float = 10.0
    interval_s: float = 30.0
    cooldown_s: float = 30.0
    cooldown_max_s: float = 600.0
    probe_s: float = 5.0


def full_plan(tmp, elastic=Elastic(), **fields):
    (tmp / "task.py").write_text("")
    fields.setdefault("tasks", {"worker": {"count": 3}})
    loaded = load_spec(write_spec(tmp, **fields))
    roles = loaded.spec.tasks.by_role()
    ports = {(r, i): 20000 + 10 * n + i for n, r in enumerate(roles) for i in range(len(roles[r]))}
    plan = make_plan(loaded, on_hosts(loaded).with_ports(ports), "r", tmp / "runs" / "r")
    return replace(plan, elastic=slots.elastic_plan(elastic, plan.tasks))


def config(task):
    return json.loads(task.env["TF_CONFIG"])


def test_a_world_renumbers_its_workers_in_slot_order_and_keeps_their_ports(tmp):
    full = full_plan(tmp)
    plan = world.world_plan(full, ["worker-2", "worker-0"])
    assert [t.name for t in plan.tasks] == ["worker-0", "worker-1"]
    w0, w1 = plan.tasks
    assert (w0.port, w1.port) == (20000, 20002)  # slot 0's and slot 2's ports
    cluster = {"worker": ["127.0.0.1:20000", "127.0.0.1:20002"]}
    assert config(w1) == {"cluster": cluster, "task": {"type": "worker", "index": 1}}
    assert w1.tf_config == config(w1)
    assert w1.env["DISTLAUNCH_INDEX"] == "1"
    assert w1.env["DISTLAUNCH_ERROR_FILE"].endswith("errors/attempt-0/worker-1.json")
    assert w1.env["DISTLAUNCH_STATUS_FILE"].endswith("status/worker-1.json")
    assert w1.env["DISTLAUNCH_METRICS_FILE"].endswith("metrics/worker-1.json")
    assert w1.log_file.endswith("logs/attempt-0/worker-1.log")


def test_the_world_env_names_its_size_the_base_and_the_batch(tmp):
    full = full_plan(tmp, Elastic(batch="per_worker"))
    plan = world.world_plan(full, ["worker-0", "worker-1"])
    for task in plan.tasks:
        assert task.env[contract.WORLD_SIZE] == "2"
        assert task.env[contract.BASE_WORKERS] == "3"
        assert task.env[contract.ELASTIC_BATCH] == "per_worker"
        assert task.env[contract.WORLD] == "2 of 2:3"
    assert contract.WORLD_SIZE not in full.tasks[0].env  # the full plan is no world


def test_chief_ps_and_evaluator_stay_and_see_the_new_cluster(tmp):
    full = full_plan(
        tmp,
        strategy="parameter_server",
        tasks={"chief": {}, "worker": {"count": 3}, "ps": {}, "evaluator": {}},
    )
    plan = world.world_plan(full, ["worker-1"])
    assert [t.name for t in plan.tasks] == ["chief-0", "worker-0", "ps-0", "evaluator-0"]
    workers = [full.task("worker-1").address]
    for name in ("chief-0", "ps-0", "worker-0"):
        assert config(plan.task(name))["cluster"]["worker"] == workers
    assert plan.task("ps-0").env["DISTLAUNCH_INDEX"] == "0"
    evaluator = plan.task("evaluator-0")
    assert config(evaluator) == config(full.task("evaluator-0"))  # its own cluster
    assert evaluator.port == full.task("evaluator-0").port


def test_the_first_world_is_the_largest_accepted_size(tmp):
    assert full_plan(tmp).elastic.first_world() == ("worker-0", "worker-1", "worker-2")
    sizes = full_plan(tmp, Elastic(min_workers=1, sizes=(1, 2))).elastic
    assert sizes.first_world() == ("worker-0", "worker-1")
    assert sizes.best_size(3) == 2 and sizes.best_size(1) == 1 and sizes.best_size(0) is None


def test_slots_and_their_places(tmp):
    elastic = full_plan(tmp).elastic
    assert [s.host for s in elastic.slots] == ["localhost"] * 3
    # This machine's slots are held out one by one: their host cannot be lost.
    assert [s.place for s in elastic.slots] == [f"worker-{i}@localhost" for i in range(3)]
    assert elastic.to_json()["workers"] == "2:3"


def test_world_plan_refuses_what_is_no_worker_slot(tmp):
    full = full_plan(tmp)
    with pytest.raises(ValueError, match="worker-7"):
        world.world_plan(full, ["worker-7"])
    with pytest.raises(ValueError, match="elastic"):
        world.world_plan(replace(full, elastic=None), ["worker-0"])


def test_world_plan_is_pure(tmp):
    full = full_plan(tmp)
    before = full.to_json()
    first = world.world_plan(full, ["worker-0", "worker-2"])
    again = world.world_plan(full, ["worker-0", "worker-2"])
    assert first == again and full.to_json() == before


# ---- the world as the loop holds it (launcher/run/elastic.py), its inputs scripted -----------


class Scripted:
    """A transport's elastic answers, scripted: which hosts it says are lost, which answer."""

    def __init__(self) -> None:
        self.lost: dict[str, str] = {}
        self.answers: set[str] = set()

    def lost_hosts(self) -> dict[str, str]:
        return dict(self.lost)

    def probe(self, host: str) -> bool:
        return host in self.answers


def on_hosts_world(tmp, transport, **fields):
    from distlaunch.launcher.run.elastic import World

    full = full_plan(tmp, Elastic(**fields))
    hosts = tuple(slots.Slot(f"worker-{i}", f"h{i + 1}", f"h{i + 1}") for i in range(3))
    full = replace(full, elastic=replace(full.elastic, slots=hosts))
    said: list[str] = []
    return World(full, transport, said.append), said


def settle(world, now):
    """Tick until the probes under way have answered (threads: at most a few ms)."""
    for _ in range(500):
        if all(probe.done() for probe in world._probing.values()):
            break
        time.sleep(0.01)
    return world.tick(now)


def test_the_world_shrinks_when_a_lost_host_stays_silent_and_grows_when_it_answers(tmp):
    from distlaunch.launcher.run.membership import Verdict

    transport = Scripted()
    world, said = on_hosts_world(
        tmp, transport, lost_after_s=5, settle_s=1, cooldown_s=2, interval_s=10
    )
    w2 = world.plan().task("worker-2")
    assert world.text() == "world 3 of 2:3" and w2.env[contract.WORLD_SIZE] == "3"
    transport.lost["h3"] = "agent lost: the link is down"
    assert world.lost_why(w2) == "agent lost: the link is down"
    assert "probing h3 for up to 5 s" in world.suspect(w2, "agent lost", now=100)
    assert world.down and world.cause == "worker-2"
    assert world.tick(100) is None  # probing
    assert settle(world, 104) is None
    assert settle(world, 105) is None and said == [
        "h3 lost: agent lost; no answer for 5 s; it may rejoin after 2 s"
    ]
    shrink = settle(world, 106)
    assert shrink.verdict is Verdict.SHRINK and shrink.slots == ("worker-0", "worker-1")
    change = world.started(shrink, now=106)
    assert (change.old, change.new, change.hosts) == (3, 2, ("h1", "h2"))
    assert world.plan().task("worker-1").env[contract.WORLD_SIZE] == "2"
    assert world.record()["worlds"] == [3, 2] and world.record()["out"] == {"h3": "lost"}
    assert settle(world, 110) is None  # h3 silent: the world stays
    transport.answers.add("h3")
    world.tick(112)  # a probe starts
    assert settle(world, 113) is None  # h3 answers; at most one resize per 10 s
    grow = settle(world, 116)
    assert grow.verdict is Verdict.GROW and grow.slots == ("worker-0", "worker-1", "worker-2")
    world.started(grow, now=116)
    assert world.record()["worlds"] == [3, 2, 3] and world.resizes == 2
    world.close()


def test_a_transport_loss_is_acted_on_once(tmp):
    transport = Scripted()
    world, _ = on_hosts_world(tmp, transport)
    assert world.transport_lost(0) == []
    transport.lost["h2"] = "node DOWN"
    assert world.transport_lost(1) == ["worker-1"] and world.down
    world.resumed()
    assert world.transport_lost(2) == []  # still listed: the same loss, not a new one
    world.close()
