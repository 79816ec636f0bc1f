"""What real hosts send a host's agent channel (launcher/transports/agent.py,
distlaunch.host.channel), on the SSH test hosts (tests/sshhosts.py): a login shell that prints a
line before anything else, one that prints for ever, and a link that stalls without a reset.

Host tests skip, with the reason, where the machine cannot make the hosts (not root, no sshd).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import standins

import sshhosts
from conftest import (
    events,
    host_cmdlines,
    run_tables,
    up_piped,
    wait_for,
    wait_for_run_dir,
    wait_tasks_up,
)

QUOTA = "Disk quota: 95% of 100 GB used"
# The login user's ~/.bashrc on each lab host: node1 talks first, node3 never stops talking.
BASHRC = {
    "node1": f'echo "{QUOTA}"\n',
    "node3": 'while :; do echo "loading modules..."; sleep 0.2; done\n',
}
# A task that listens on its TF_CONFIG port (the launcher sees it join), says so, and exits 0
# once the run dir holds "go" (or sleeps, for the stall test).
UNTIL_GO = (
    standins.listening(standins.ANY)
    + "import os, time\nprint('up', os.getpid(), flush=True)\n"
    + "while not os.path.exists(os.path.join(os.environ['DISTLAUNCH_RUN_DIR'], 'go')):\n"
    + "    time.sleep(0.1)\n"
)


@pytest.fixture(scope="module")
def talking_lab():
    """Three SSH test hosts whose login shells say what BASHRC says."""
    reason = sshhosts.unavailable_reason()
    if reason is None and not sshhosts._shell_rcs():
        reason = "root has no ~/.bashrc here for a host's own to stand in for"
    if reason is not None:
        pytest.skip(reason)
    with sshhosts.HostLab(3, bashrc=BASHRC) as made:
        yield made


def _spec(
    folder: Path, lab: sshhosts.HostLab, hosts: list[sshhosts.TestHost], startup_s: int
) -> None:
    (folder / "task.py").write_text(UNTIL_GO)
    spec = {
        "name": "talk",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py"},
        "hosts": {h.name: lab.host_entry(h) for h in hosts},
        "tasks": {"worker": [{"host": h.name} for h in hosts]},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": startup_s},
    }
    (folder / "spec.json").write_text(json.dumps(spec))


@pytest.mark.integration
def test_a_login_shell_that_talks_first_runs_and_its_words_are_in_the_hosts_log(
    talking_lab, tmp: Path
) -> None:
    lab: sshhosts.HostLab = talking_lab
    node1, node2, _ = lab.hosts
    _spec(tmp, lab, [node1, node2], startup_s=120)
    launcher = up_piped(tmp)
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_tasks_up(run_dir, 2, launcher)
        (run_dir / "go").write_text("go")
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err
    noisy = (run_dir / "logs" / "attempt-0" / "worker-0.log").read_text()
    quiet = (run_dir / "logs" / "attempt-0" / "worker-1.log").read_text()
    assert QUOTA in noisy and f"{node1.name}" in noisy.split(QUOTA)[0], noisy
    assert QUOTA not in quiet, quiet
    assert "Traceback" not in err, err
    wait_for(lambda: not any(lab.processes(h) for h in lab.hosts), "the hosts to be empty", 60)


@pytest.mark.integration
def test_a_login_shell_that_prints_for_ever_ends_the_run_in_one_line_naming_the_host(
    talking_lab, tmp: Path
) -> None:
    lab: sshhosts.HostLab = talking_lab
    node1, _, node3 = lab.hosts
    startup_s = 240
    _spec(tmp, lab, [node1, node3], startup_s=startup_s)
    launcher = up_piped(tmp)
    try:
        out, err = launcher.communicate(timeout=startup_s)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode in (1, 2), err
    named = [line for line in err.splitlines() if node3.name in line and "loading modules" in line]
    assert len(named) == 1, err
    assert "Traceback" not in err, err
    print(named[0])
    wait_for(lambda: not any(lab.processes(h) for h in lab.hosts), "the hosts to be empty", 60)


@pytest.mark.integration
def test_a_link_that_stalls_without_a_reset_is_named_and_leaves_nothing_once_it_returns(
    talking_lab, tmp: Path
) -> None:
    """Every packet of the host's cable dropped, both ways (an nft drop there): no reset, no
    FIN; TCP and ssh say nothing for minutes. The launcher names the host from its agent's
    silence; the agent, hearing no launcher, ends its task, removes its rules and exits on its
    own; once the link returns nothing of the run is left there. The stall lasts until both
    ends have shown that (up to 60 s each), not a fixed window: what happens after it is the
    same whenever it ends."""
    lab: sshhosts.HostLab = talking_lab
    node1, node2, _ = lab.hosts
    if shutil.which("nft") is None:
        pytest.skip("nft is not installed (apt-get install nftables)")
    _spec(tmp, lab, [node1, node2], startup_s=120)
    launcher = up_piped(tmp)
    # Every packet in or out of the host's cable dropped, by a table of the test's own in the
    # host's namespace (the agent's own table is another: it removes that one as it ends).
    leg = f"{node2.netns}v"
    stall = (
        "table inet dlstall {\n"
        f'  chain in {{ type filter hook input priority -100; iifname "{leg}" drop; }}\n'
        f'  chain out {{ type filter hook output priority -100; oifname "{leg}" drop; }}\n'
        "}\n"
    )

    def stalled(op: str) -> None:
        nft = ["ip", "netns", "exec", node2.netns, "nft"]
        if op == "add":
            subprocess.run([*nft, "-f", "-"], input=stall, text=True, check=True)
        else:
            subprocess.run([*nft, "delete", "table", "inet", "dlstall"], check=False)

    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_tasks_up(run_dir, 2, launcher)
        stalled("add")
        stalled_at = time.time()
        try:
            out, err = launcher.communicate(timeout=120)
            named_after = time.time() - stalled_at
            # The agent heard nothing for its heartbeat timeout: it ended its task and exited,
            # while the link still drops everything.
            wait_for(
                lambda: "distlaunch" not in host_cmdlines(lab, node2),
                "the stalled host's agent and task to end",
                60,
            )
            agent_gone_after = time.time() - stalled_at
        finally:
            stalled("del")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1, err
    log = (run_dir / "logs" / "attempt-0" / "worker-1.log").read_text()
    assert f"lost the agent on {node2.name} (" in log and "no word from the agent" in log, log
    assert "failed: worker-1" in err, err
    assert "Traceback" not in err, err
    ended = [e for e in events(run_dir) if e.get("task") == "worker-1" and "exit" in e]
    # Figures, not assertions (bench/ holds the timed checks).
    print(
        f"stall named after {ended[0]['time'] - stalled_at:.1f} s (launcher exited after "
        f"{named_after:.1f} s); the agent ended on its own after {agent_gone_after:.1f} s"
    )
    wait_for(lambda: not any(lab.processes(h) for h in lab.hosts), "every host to be empty", 60)
    assert run_tables(node2) == []
