"""A run's firewall rules on one host, and the tools that add and remove them (nft, or iptables
where nft is missing): what `distlaunch.host.guard` and the agent's firewall job
(`distlaunch.host.wall`) install. Pure script makers (`nft_ruleset`, `iptables_scripts`) show
`plan` exactly what a host gets.

Installing and removing are idempotent: an install first removes what an earlier install of the
same name left (nft replaces its table in one transaction; iptables deletes every INPUT jump to
its chain and the chain), and a removal deletes every jump it finds, so installing the iptables
fallback twice never leaves a DROP chain behind. Standard library only.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from distlaunch.host.timeouts import TOOL_TIMEOUT_S

TABLE_PREFIX = "distlaunch_"
# Before the usual filter chains (priority 0): our drop is final whatever they accept.
CHAIN_PRIORITY = -10
# A login user's PATH often lacks the sbin folders where nft lives.
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
# iptables waits this long for the xtables lock (within TOOL_TIMEOUT_S).
_LOCK_WAIT_S = "3"


class Unprotected(Exception):
    """The host cannot be firewalled; the message says why, in words for the user."""


def table_name(name: str) -> str:
    """``distlaunch_<name>`` (a name of `NAME`'s characters)."""
    return TABLE_PREFIX + name


def nft_ruleset(table: str, ports: tuple[int, ...], allowed: list[str]) -> str:
    """The nftables script that creates ``table``: ``ports`` admit ``allowed`` and loopback only.

    Pure, so that `distlaunch plan` shows exactly what a guard installs. ``allowed`` are IP
    addresses (already resolved); the first line deletes a table of that name left by an earlier
    guard of the same run and host (names are unique to them), in the same atomic transaction.
    """
    addresses = [ipaddress.ip_address(a) for a in allowed]
    port_set = "{ " + ", ".join(str(p) for p in ports) + " }"
    lines = [
        f"table inet {table}",
        f"delete table inet {table}",
        f"table inet {table} {{",
        "  chain input {",
        f"    type filter hook input priority {CHAIN_PRIORITY}; policy accept;",
        '    iifname "lo" accept',
    ]
    for family, version in (("ip", 4), ("ip6", 6)):
        chosen = sorted({str(a) for a in addresses if a.version == version})
        if chosen:
            lines.append(
                f"    tcp dport {port_set} {family} saddr {{ {', '.join(chosen)} }} accept"
            )
    lines += [f"    tcp dport {port_set} drop", "  }", "}", ""]
    return "\n".join(lines)


def program(name: str) -> str | None:
    """A firewall program, looked up on PATH and in the sbin folders."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))


def chain_name(name: str) -> str:
    """The iptables chain of a guard: iptables allows 28 characters, so a digest of its name."""
    return "DL-" + hashlib.sha256(name.encode()).hexdigest()[:24]


def iptables_scripts(
    chain: str, ports: tuple[int, ...], allowed: list[str], version: int
) -> tuple[str, str]:
    """The `iptables-restore --noflush` scripts (IP ``version`` 4 or 6) that add and remove the run's
    chain: INPUT jumps to it for the task ports, it returns for loopback and ``allowed`` and drops
    the rest. Pure, like `nft_ruleset`; each script is applied atomically."""
    addresses = sorted({str(a) for a in map(ipaddress.ip_address, allowed) if a.version == version})
    # multiport takes at most 15 ports per rule.
    jumps = [
        f"-p tcp -m multiport --dports {','.join(str(p) for p in ports[i : i + 15])} -j {chain}"
        for i in range(0, len(ports), 15)
    ]
    add = [
        "*filter",
        f":{chain} - [0:0]",
        f"-A {chain} -i lo -j RETURN",
        *[f"-A {chain} -s {a} -j RETURN" for a in addresses],
        f"-A {chain} -j DROP",
        *[f"-I INPUT {jump}" for jump in jumps],
        "COMMIT",
    ]
    remove = [
        "*filter",
        *[f"-D INPUT {jump}" for jump in jumps],
        f"-F {chain}",
        f"-X {chain}",
        "COMMIT",
    ]
    return "\n".join(add) + "\n", "\n".join(remove) + "\n"


@dataclass(frozen=True)
class Installed:
    """Rules an install added: how, under which name (the nftables table or the iptables chain),
    the rules' own name (``rules``, the request's) and the commands that take an nftables table
    away (by its handle)."""

    how: str  # "nftables" or "iptables"
    name: str
    rules: str
    undo: tuple[tuple[tuple[str, ...], str], ...] = ()  # (argv, stdin) of each removal

    def remove(self) -> None:
        """Take the rules away (what is already gone is no error)."""
        for argv, script in self.undo:
            _apply(argv, script)
        if self.how == "iptables":
            try:
                remove_chains(self.rules)
            except Unprotected:
                pass  # nothing more can be done here; `distlaunch down` tries again


def install(name: str, ports: tuple[int, ...], allowed: list[str]) -> Installed:
    """Add rules ``name``: an nftables table, or iptables chains where nft is missing. Raise
    Unprotected when neither can be done."""
    nft = program("nft")
    table = table_name(name)
    if nft is not None:
        _check(_apply((nft, "-f", "-"), nft_ruleset(table, ports, allowed)), "nft")
        # By handle: a later guard of the run that replaced this table keeps its own.
        handle = table_handle(nft, table)
        which = f"handle {handle}" if handle is not None else table
        return Installed(
            "nftables", table, name, (((nft, "-f", "-"), f"delete table inet {which}\n"),)
        )
    tools = [program("iptables-restore"), program("ip6tables-restore")]
    if None in tools:
        raise Unprotected(
            "neither nft nor iptables-restore and ip6tables-restore are installed here (apt-get install nftables)"
        )
    chain = chain_name(name)
    installed = Installed("iptables", chain, name)
    try:
        remove_chains(name)  # what an earlier install of this name left: never two jumps
        for tool, version in zip(tools, (4, 6), strict=True):
            add, _ = iptables_scripts(chain, ports, allowed, version)
            _check(_apply((str(tool), "--noflush", "-w", _LOCK_WAIT_S), add), Path(str(tool)).name)
    except Unprotected:
        installed.remove()
        raise
    return installed


def table_handle(nft: str, table: str) -> int | None:
    """The handle nft gave ``table`` (``table inet NAME { # handle 7``); None if it is not there."""
    listed = _apply((nft, "-a", "list", "table", "inet", table), "")
    found = re.match(r"table inet \S+ \{ # handle (\d+)", listed.stdout)
    return int(found.group(1)) if listed.returncode == 0 and found else None


# What `_apply` says of a tool that did not answer in time (a hung nft, iptables' lock).
_TIMED_OUT = 124


def _apply(argv: tuple[str, ...], script: str) -> subprocess.CompletedProcess:
    """Run a firewall tool on ``script``; one that takes longer than TOOL_TIMEOUT_S is killed
    and reads as having failed (`_TIMED_OUT`)."""
    try:
        return subprocess.run(
            list(argv),
            check=False,
            input=script,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, _TIMED_OUT, "", "")


def _check(done: subprocess.CompletedProcess, tool: str) -> None:
    if done.returncode == 0:
        return
    if done.returncode == _TIMED_OUT and not done.stderr:
        raise Unprotected(f"{tool} did not answer within {TOOL_TIMEOUT_S:g} s")
    lines = done.stderr.strip().splitlines()
    message = lines[-1] if lines else f"exit code {done.returncode}"
    if any(
        word in done.stderr
        for word in ("Operation not permitted", "Permission denied", "must be root")
    ):
        raise Unprotected(
            f"user {_user()} may not change the firewall here: it needs root or CAP_NET_ADMIN ({tool}: {message})"
        )
    raise Unprotected(f"{tool} refused the rules: {message}")


def remove_leftovers(name: str) -> list[str]:
    """Delete the rules named ``name`` on this host (what a SIGKILLed guard left); return what
    was removed (e.g. ``nftables table inet distlaunch_r_1a2b``). Raise Unprotected when they
    cannot be removed."""
    removed = []
    nft = program("nft")
    table = table_name(name)
    if nft is not None and _apply((nft, "list", "table", "inet", table), "").returncode == 0:
        _check(_apply((nft, "-f", "-"), f"delete table inet {table}\n"), "nft")
        removed.append(f"nftables table inet {table}")
    return removed + remove_chains(name)


def remove_chains(name: str) -> list[str]:
    """Delete the iptables chains of rules ``name`` (IPv4 and IPv6) and every INPUT jump to
    them, however many there are; what was removed."""
    removed = []
    chain = chain_name(name)
    for save, restore in (
        ("iptables-save", "iptables-restore"),
        ("ip6tables-save", "ip6tables-restore"),
    ):
        tools = program(save), program(restore)
        if None in tools:
            continue
        listed = _apply((str(tools[0]), "-t", "filter"), "")
        if f":{chain} " not in listed.stdout:
            continue
        jumps = [
            "-D" + line[2:]
            for line in listed.stdout.splitlines()
            if line.startswith("-A INPUT ") and line.endswith(f" -j {chain}")
        ]
        script = "\n".join(["*filter", *jumps, f"-F {chain}", f"-X {chain}", "COMMIT", ""])
        _check(_apply((str(tools[1]), "--noflush", "-w", _LOCK_WAIT_S), script), restore)
        removed.append(f"{save.removesuffix('-save')} chain {chain}")
    return removed


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())
