"""Every timeout of the launcher's channel to a host's agent, in one table: its name, its value,
who waits on it, and how it must relate to the others (tests/test_timeouts.py asserts the
relations, so a change to one value that breaks them fails there, not on a cluster).

Both sides read it: the agent and its keepers and guard (standard library only, run by path on a
Slurm node) and the launcher (which may import `distlaunch.host`, never the reverse). Values the
launcher sends the agent in its hello (``heartbeat_s``, ``beat_s``) come from here too.
"""

from __future__ import annotations

from dataclasses import dataclass

# The launcher writes a heartbeat line to each agent this often, and each agent an ``h`` frame.
HEARTBEAT_S = 2.0
# The launcher ends an agent's client that has said nothing for this long (a link that stalls
# without a reset: TCP and ssh's keepalives take 15 s or more to say so).
AGENT_SILENCE_S = 10.0
# An agent, keeper or guard whose launcher has said nothing for this long ends what it holds.
HEARTBEAT_TIMEOUT_S = 20.0
# Once a host has started talking, its agent's hello must come within this long: a login shell
# that prints and never runs the agent (a loop in .bashrc) is named, not waited on for ever.
HELLO_S = 30.0
# The agent's firewall install (in a child of its own, off its loop) must answer within this
# long; past it the agent kills the install, removes what it added and answers "unprotected".
FIREWALL_S = 8.0
# One nft/iptables call's limit inside that install.
TOOL_TIMEOUT_S = 5.0
# How long the launcher waits for every host's firewall answer.
ANSWER_TIMEOUT_S = 60.0
# After `kill`, how long an agent has to report its tasks' ends before its client is ended.
KILL_WAIT_S = 10.0
# After its stdin closes, how long an agent's client has to exit before it is killed.
CLOSE_WAIT_S = 10.0
# After a keeper exits, how long its output pipe may stay open (a process it failed to end).
DRAIN_S = 1.0
# How long an ending agent waits for its keepers to end their tasks before it exits anyway.
END_WAIT_S = 60.0
# How long a guard keeps its rules after its end was asked for while a task port still listens.
LINGER_S = 10.0


@dataclass(frozen=True)
class Timeout:
    """One row of the table: ``relation`` is an expression over this module's names that must
    hold (tests/test_timeouts.py evaluates every one), ``why`` says why."""

    name: str
    seconds: float
    who_waits: str
    relation: str
    why: str


TABLE = (
    Timeout(
        "HEARTBEAT_S",
        HEARTBEAT_S,
        "both ends: the period of their beats",
        "HEARTBEAT_S * 2 < AGENT_SILENCE_S",
        "a beat or two may be late on a busy machine without a link being taken for dead",
    ),
    Timeout(
        "AGENT_SILENCE_S",
        AGENT_SILENCE_S,
        "the launcher's hub, of an agent that says nothing",
        "FIREWALL_S < AGENT_SILENCE_S < HEARTBEAT_TIMEOUT_S",
        "a firewall install never looks like silence, and the launcher names a stalled link "
        "before the host gives up on it",
    ),
    Timeout(
        "HEARTBEAT_TIMEOUT_S",
        HEARTBEAT_TIMEOUT_S,
        "the agent, keepers and guard, of a launcher that says nothing",
        "HEARTBEAT_TIMEOUT_S >= 2 * AGENT_SILENCE_S",
        "the host ends what it holds only once the launcher has surely given up on it",
    ),
    Timeout(
        "HELLO_S",
        HELLO_S,
        "the launcher's hub, of a host that talks but whose agent never speaks",
        "HELLO_S + FIREWALL_S < ANSWER_TIMEOUT_S",
        "a slow login shell and then the install still answer within the firewall wait",
    ),
    Timeout(
        "FIREWALL_S",
        FIREWALL_S,
        "the agent, of its firewall install (a fork)",
        "TOOL_TIMEOUT_S < FIREWALL_S < AGENT_SILENCE_S",
        "one tool's hang is cut before the install's own deadline, which the launcher outwaits",
    ),
    Timeout(
        "TOOL_TIMEOUT_S",
        TOOL_TIMEOUT_S,
        "the firewall install, of one nft or iptables call",
        "TOOL_TIMEOUT_S < FIREWALL_S",
        "see FIREWALL_S",
    ),
    Timeout(
        "ANSWER_TIMEOUT_S",
        ANSWER_TIMEOUT_S,
        "the launcher, of every host's firewall answer",
        "ANSWER_TIMEOUT_S > HELLO_S + FIREWALL_S",
        "see HELLO_S",
    ),
    Timeout(
        "KILL_WAIT_S",
        KILL_WAIT_S,
        "the launcher, of an agent's report of the tasks it was told to kill",
        "KILL_WAIT_S > DRAIN_S + HEARTBEAT_S",
        "a killed task's last output and end come before its agent is taken for gone",
    ),
    Timeout(
        "CLOSE_WAIT_S",
        CLOSE_WAIT_S,
        "the launcher, of an agent's client after EOF",
        "CLOSE_WAIT_S > DRAIN_S",
        "the agent reports its ends first",
    ),
    Timeout(
        "DRAIN_S",
        DRAIN_S,
        "the agent, of a keeper's output after its exit",
        "DRAIN_S < HEARTBEAT_S",
        "a task's end is never held past a beat",
    ),
    Timeout(
        "END_WAIT_S",
        END_WAIT_S,
        "the agent, of its keepers as it ends",
        "END_WAIT_S > LINGER_S + DRAIN_S",
        "keepers that stop their tasks gracefully get the time a guard gives ports to close",
    ),
    Timeout(
        "LINGER_S",
        LINGER_S,
        "the agent or guard, of the task ports before it removes the rules",
        "LINGER_S > DRAIN_S",
        "the tasks are gone before their ports are opened to anyone",
    ),
)
