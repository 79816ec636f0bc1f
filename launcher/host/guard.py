"""The remote end of a run's firewall: one guard per host holds an nftables table for the run's life.

TensorFlow's gRPC servers listen on every interface with no authentication. On a host of a run
across machines, this guard admits TCP connections to the run's task ports on that host only from
the run's own hosts and loopback, and drops all others. A run's guard on a host is the host's
agent (`distlaunch.host.agent`, over SSH or as a Slurm node's job step): it takes the request
below over its channel and installs and removes the rules with this module's functions.
``python -m distlaunch.host.guard`` does the same as a process of its own, over its stdin:

- line 1 is a JSON request: ``{"run_id": "...", "name": "...", "ports": [2222, ...], "allow":
  ["10.0.0.11", "node2", ...], "allow_client": true, "heartbeat_s": 20}``. ``name`` names this
  guard's rules (the launcher makes it unique per run dir and host: `distlaunch.launcher.network.firewall`);
  ``allow`` names who may connect (IPv4 or IPv6 addresses, or names this host resolves);
  ``allow_client`` adds the address the SSH session comes from (``SSH_CONNECTION``): the
  launcher's when it connects directly (through NAT, too). EOF in place of the request: it
  exits 0 with nothing changed.
- it answers one JSON line on stdout: ``{"protected": true, "how": "nftables", "table": "...",
  "allowed": [...]}`` (``how`` is ``iptables`` and ``table`` a chain where nft is missing), or
  ``{"protected": false, "why": "..."}`` and exits (no CAP_NET_ADMIN, no nft nor iptables):
  nothing was changed on the host.
- every later line is a heartbeat. The rules stay until stdin reaches EOF (the launcher closed
  it, died, or its connection dropped), no line arrives for ``heartbeat_s``, or SIGTERM, SIGHUP or
  SIGINT arrives. The guard then waits (at most LINGER_S) until no socket listens on the ports any
  more, so the tasks it protects are gone first, and deletes its rules.

The rules are one nftables table (``inet distlaunch_<name>``) with its own input chain: nothing
else of the host's firewall is read or changed, and deleting the table removes every rule at once.
Two runs never share a name, so a guard's first step, replacing a table of its name (what an
earlier, SIGKILLed guard of the same run and host left), can only touch its own run's rules; and
it deletes the table by the handle nft gave it, so a table that a later attempt of the run put in
its place is never removed by the earlier guard. Where nft is missing, iptables does the same with
a chain (``DL-<digest of the name>``, IPv4 and IPv6) that INPUT jumps to for the task ports. A
guard that is SIGKILLed cannot clean up: that is the one way to leave its rules behind. ``python
-m distlaunch.host.guard --remove NAME`` removes what a guard of that name left on the host (its
table, or its chains and INPUT's jumps to them); `distlaunch down` runs it on a Slurm run's nodes,
with the names run.json recorded, where a cancelled step or a killed srun SIGKILLs the agent.

Request values are data: ports must be integers, addresses go through `ipaddress`, a name must be
``[A-Za-z0-9_]`` only. Imports only the standard library, never
launcher code.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from distlaunch.host import rules
from distlaunch.host.rules import (  # the rules themselves, and what adds and removes them
    TABLE_PREFIX,
    Installed,
    Unprotected,
    chain_name,
    iptables_scripts,
    nft_ruleset,
    remove_leftovers,
    table_name,
)
from distlaunch.host.timeouts import LINGER_S

__all__ = [
    "TABLE_PREFIX",
    "Installed",
    "Unprotected",
    "chain_name",
    "iptables_scripts",
    "nft_ruleset",
    "remove_leftovers",
    "table_name",
    "LINGER_S",
]

# What a rule name may be: nft reads it as a plain name, and with the prefix it stays far below
# nft's 256 characters (the launcher's names are at most 128 + 13).
NAME = re.compile(r"[A-Za-z0-9_]{1,200}")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_LISTEN = "0A"


@dataclass(frozen=True)
class Request:
    """What one guard protects: the name of its rules, the ports on this host, who may connect."""

    run_id: str
    name: str
    ports: tuple[int, ...]
    allow: tuple[str, ...]
    allow_client: bool = True
    heartbeat_s: float | None = None
    # The spec's network.protect is "required": an agent that cannot install the rules starts
    # none of its tasks.
    required: bool = False

    @property
    def table(self) -> str:
        """The nftables table of this guard."""
        return table_name(self.name)


def parse(line: bytes) -> Request:
    """The request line as a Request; ValueError or TypeError when it is malformed."""
    data = json.loads(line)
    if not isinstance(data, dict):
        raise TypeError("expected a JSON object")
    ports, allow = data.get("ports"), data.get("allow", [])
    if not (isinstance(ports, list) and ports and all(_is_port(p) for p in ports)):
        raise ValueError("ports must be a non-empty list of port numbers")
    if not (isinstance(allow, list) and all(isinstance(a, str) and a for a in allow)):
        raise ValueError("allow must be a list of addresses or host names")
    if not isinstance(data.get("run_id"), str) or not data["run_id"]:
        raise ValueError("run_id must be a non-empty string")
    name = data.get("name")
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        raise ValueError("name must be 1-200 letters, digits or '_'")
    heartbeat = data.get("heartbeat_s")
    return Request(
        run_id=data["run_id"],
        name=name,
        ports=tuple(sorted(set(ports))),
        allow=tuple(allow),
        allow_client=bool(data.get("allow_client", True)),
        heartbeat_s=float(heartbeat) if heartbeat else None,
        required=data.get("required") is True,
    )


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


def resolve(request: Request) -> list[str]:
    """Every address the run's hosts have, as this host resolves them, plus the SSH client's."""
    found: set[str] = set()
    for name in request.allow:
        try:
            found.add(str(ipaddress.ip_address(name)))
            continue
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError:
            continue  # a peer this host cannot resolve cannot be dialled by its tasks either
        found.update(str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos)
    client = os.environ.get("SSH_CONNECTION", "").split()
    if request.allow_client and client:
        found.add(str(ipaddress.ip_address(client[0])))
    return sorted(found)


def install(request: Request, allowed: list[str]) -> Installed:
    """Add the request's rules (`rules.install`): ``allowed`` alone reaches its ports."""
    return rules.install(request.name, request.ports, allowed)


def listening(ports: tuple[int, ...]) -> bool:
    """Whether a TCP socket of this network namespace listens on any of ``ports``."""
    wanted = {f"{p:04X}" for p in ports}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    # fields[1] is local_address (hex ip:port), fields[3] the state.
                    if (
                        len(fields) > 3
                        and fields[3] == _LISTEN
                        and fields[1].rsplit(":", 1)[1] in wanted
                    ):
                        return True
        except FileNotFoundError:
            continue
    return False


def trap_signals() -> tuple[list[int], int]:
    """Record SIGTERM, SIGHUP and SIGINT instead of dying of them; return the list they land in
    and a descriptor that becomes readable when one arrives."""
    stopped: list[int] = []
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    signal.set_wakeup_fd(wake_w)
    return stopped, wake_r


def hold(request: Request, stopped: list[int], wake_r: int) -> str:
    """Wait until the guard must end (see `trap_signals` for ``stopped`` and ``wake_r``); return
    why, in words."""
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    sel.register(wake_r, selectors.EVENT_READ, "signal")
    last_heard = time.monotonic()
    while not stopped:
        timeout = None
        if request.heartbeat_s is not None:
            timeout = max(0.0, last_heard + request.heartbeat_s - time.monotonic())
        for key, _ in sel.select(timeout):
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 65536):
                    return "the launcher's connection closed"
                last_heard = time.monotonic()
        if request.heartbeat_s is not None and time.monotonic() - last_heard > request.heartbeat_s:
            return f"no word from the launcher for {request.heartbeat_s:g} s"
    return f"this guard got {signal.Signals(stopped[0]).name}"


def main() -> int:
    """Protect the ports the request on stdin names until told to stop; 0 unless the request was bad.

    With ``--remove NAME``: remove what a guard of that name left here; print
    ``{"removed": [...]}`` (1 and a ``why`` when that fails; 2 for a name that is none).
    """
    if sys.argv[1:2] == ["--remove"] and len(sys.argv) == 3:
        if not NAME.fullmatch(sys.argv[2]):
            _say(f"--remove: expected a name of letters, digits and '_', got {sys.argv[2]!r}")
            return 2
        try:
            _answer({"removed": remove_leftovers(sys.argv[2])})
        except Unprotected as exc:
            _answer({"removed": [], "why": str(exc)})
            return 1
        return 0
    line = _first_line(sys.stdin.fileno())
    if line is None:
        return 0  # not needed after all: nothing to do
    try:
        request = parse(line)
    except (ValueError, TypeError) as exc:
        _say(f"bad request from the launcher: {exc}")
        return 2
    # Trapped before the table exists: a stop signal in between must still lead to its removal.
    stopped, wake_r = trap_signals()
    allowed = resolve(request)
    try:
        installed = install(request, allowed)
    except Unprotected as exc:
        _answer({"protected": False, "why": str(exc)})
        return 0
    try:
        _answer(
            {
                "protected": True,
                "how": installed.how,
                "table": installed.name,
                "allowed": allowed,
            }
        )
        why = hold(request, stopped, wake_r)
        deadline = time.monotonic() + LINGER_S
        while listening(request.ports) and time.monotonic() < deadline:
            time.sleep(0.1)
        _say(f"{why}: removing the {installed.how} rules {installed.name} of run {request.run_id}")
    finally:
        installed.remove()
    return 0


def _first_line(fd: int) -> bytes | None:
    # Byte by byte: nothing past the first line may be read ahead of `hold`'s select.
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            return None
        line += byte
    return line


def _answer(data: dict) -> None:
    try:
        sys.stdout.write(json.dumps(data) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        pass  # the launcher is gone; the table still goes in `main`'s finally


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"distlaunch.host.guard: {message}\n")
        sys.stderr.flush()
    except (BrokenPipeError, OSError):
        pass


if __name__ == "__main__":
    sys.exit(main())
