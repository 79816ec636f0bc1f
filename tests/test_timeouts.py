"""The one table of the channel's timeouts (distlaunch.host.timeouts): every relation it states
holds, every timeout has its row, and the launcher's and the hosts' modules wait on these values,
not on copies of their own."""

from __future__ import annotations

import pytest

from distlaunch.host import rules, timeouts
from distlaunch.launcher.network import firewall
from distlaunch.launcher.transports import agent, agent_hub, agent_link, helper

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("row", timeouts.TABLE, ids=lambda row: row.name)
def test_each_relation_holds(row: timeouts.Timeout) -> None:
    names = {t.name: t.seconds for t in timeouts.TABLE}
    assert eval(row.relation, {}, names), f"{row.relation}: {row.why}"  # noqa: S307 - our table


def test_every_timeout_has_one_row_with_its_value() -> None:
    constants = {
        name: value
        for name, value in vars(timeouts).items()
        if name.endswith("_S") and isinstance(value, float)
    }
    rows = {row.name: row.seconds for row in timeouts.TABLE}
    assert rows == constants
    assert len(rows) == len(timeouts.TABLE)


def test_the_named_relations_are_the_issues() -> None:
    """The firewall's deadline is below the launcher's silence limit, which is below the host's."""
    assert timeouts.FIREWALL_S < timeouts.AGENT_SILENCE_S < timeouts.HEARTBEAT_TIMEOUT_S
    assert float(rules._LOCK_WAIT_S) < timeouts.TOOL_TIMEOUT_S


def test_both_sides_wait_on_the_tables_values() -> None:
    assert agent.AGENT_SILENCE_S is timeouts.AGENT_SILENCE_S
    assert agent_link.AGENT_SILENCE_S is timeouts.AGENT_SILENCE_S
    assert agent_link.HELLO_S is timeouts.HELLO_S
    assert agent_link.HEARTBEAT_S is timeouts.HEARTBEAT_S
    assert agent_hub.HEARTBEAT_S is timeouts.HEARTBEAT_S
    assert firewall.ANSWER_TIMEOUT_S is timeouts.ANSWER_TIMEOUT_S
    assert helper.HEARTBEAT_TIMEOUT_S is timeouts.HEARTBEAT_TIMEOUT_S
    assert rules.TOOL_TIMEOUT_S is timeouts.TOOL_TIMEOUT_S
