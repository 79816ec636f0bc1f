"""The chief's result, told to the ps and worker servers where no launcher stops them.

Under ParameterServerStrategy only the chief runs the program; ps and worker tasks serve until
someone stops them. `distlaunch up` does (it sees the chief exit). Where nothing watches the run,
in the Jobs of `distlaunch k8s` and a `distlaunch compose` file run by hand, the chief tells them:

- the chief runs as ``python -m distlaunch.worker.chief_result -- PROGRAM ARGS...``: the program
  in a child process (stop signals passed on), then, once it ended on its own, this process
  serves its exit code on the chief's task port (free again: the program's TensorFlow server died
  with it) until every ps and worker task has read it, at most LINGER_S, and exits with that
  code. A chief stopped from outside (its pod deleted, `docker compose down`) publishes nothing.
- every ps and worker task whose environment has END_WITH_CHIEF polls the chief's address every
  POLL_S and ends once the chief's result is final: exit 0 when it succeeded; when it failed for
  good (an exit code in ``final`` or more failures than the chief's Job ``retries``) the first of
  ``final`` (so Kubernetes' podFailurePolicy fails the server's Job at once), or 1 without one.
  A failure with retries left is counted and the task goes on serving the next chief.

The task port is the one the NetworkPolicy (Kubernetes) or the internal network (compose) admits
from the run's tasks only. A connection to the chief's port that is not this result (the
program's TensorFlow server) is closed at once. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from . import contract

# How often a server asks the chief's address for its result.
POLL_S = 1.0
# How long a finished chief waits for every server to read its result.
LINGER_S = 60.0
# How long one look at the chief's address may take (connect, then read a line).
LOOK_S = 1.0
_MAGIC = b"distlaunch-chief-result"


@dataclass(frozen=True)
class EndRule:
    """When a server ends with the chief: its Job's retries and the codes it never retries."""

    retries: int
    final: tuple[int, ...]

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> EndRule | None:
        """The rule in END_WITH_CHIEF, or None where the task serves until it is stopped."""
        value = environ.get(contract.END_WITH_CHIEF)
        if not value:
            return None
        data = json.loads(value)
        return cls(int(data["retries"]), tuple(int(c) for c in data["final"]))

    def to_env(self) -> str:
        """The value of END_WITH_CHIEF that `from_env` reads back."""
        return json.dumps({"retries": self.retries, "final": list(self.final)})

    def fail_code(self) -> int:
        """A server's exit code when the chief failed for good."""
        return self.final[0] if self.final else 1


@dataclass(frozen=True)
class Result:
    """One chief's end: which run of the chief (``id``) and its exit code."""

    id: str
    code: int

    def line(self) -> bytes:
        """The line the chief serves."""
        return b"%s %s %d\n" % (_MAGIC, self.id.encode(), self.code)

    @classmethod
    def parse(cls, data: bytes) -> Result | None:
        """The result in ``data``, or None when it is not one (another server on that port)."""
        parts = data.split(b"\n", 1)[0].split()
        if len(parts) != 3 or parts[0] != _MAGIC or not parts[2].lstrip(b"-").isdigit():
            return None
        return cls(parts[1].decode(errors="replace"), int(parts[2]))


class Verdicts:
    """A server's decision on each result it reads: an exit code, or None to go on serving."""

    def __init__(self, rule: EndRule) -> None:
        self.rule = rule
        self.failures: set[str] = set()

    def verdict(self, result: Result) -> int | None:
        """0 for a success; the rule's fail code for a final failure; None while the chief's Job
        may still retry it."""
        if result.code == 0:
            return 0
        self.failures.add(result.id)
        if result.code in self.rule.final or len(self.failures) > self.rule.retries:
            return self.rule.fail_code()
        return None


def _address(tf_config: str) -> tuple[str, int] | None:
    """(host, port) of the chief in TF_CONFIG, or None when the cluster has no chief."""
    chiefs = json.loads(tf_config).get("cluster", {}).get(contract.CHIEF) or []
    if not chiefs:
        return None
    host, _, port = chiefs[0].rpartition(":")
    return host, int(port)


def _servers(tf_config: str) -> set[str]:
    """The names of the ps and worker tasks in TF_CONFIG."""
    cluster = json.loads(tf_config).get("cluster", {})
    return {
        contract.task_name(role, i)
        for role in (contract.PS, contract.WORKER)
        for i in range(len(cluster.get(role) or []))
    }


# ---- the servers' side --------------------------------------------------------------------------


def look(address: tuple[str, int], name: str) -> Result | None:
    """The chief's result if it serves one at ``address`` now (acknowledged as ``name``)."""
    try:
        with socket.create_connection(address, timeout=LOOK_S) as conn:
            conn.settimeout(LOOK_S)
            data = b""
            while b"\n" not in data and len(data) < 256:
                got = conn.recv(256)
                if not got:
                    break
                data += got
            result = Result.parse(data)
            if result is not None:
                conn.sendall(name.encode() + b"\n")
            return result
    except OSError:  # not there yet, not resolvable yet, refused, silent (a gRPC server)
        return None


def watch_in_background(name: str) -> None:
    """Where END_WITH_CHIEF says so, end this server process with the chief (see the module
    docstring) from a daemon thread; nothing otherwise."""
    rule = EndRule.from_env(os.environ)
    address = _address(os.environ.get(contract.TF_CONFIG, "{}")) if rule else None
    if rule is None or address is None:
        return
    threading.Thread(
        target=_watch, args=(Verdicts(rule), address, name), name="chief-watch", daemon=True
    ).start()


def _watch(verdicts: Verdicts, address: tuple[str, int], name: str) -> None:
    while True:
        result = look(address, name)
        code = None if result is None else verdicts.verdict(result)
        if code is not None:
            how = "succeeded" if result.code == 0 else f"failed (exit {result.code})"
            print(f"distlaunch: {name}: the chief {how}; this server ends", flush=True)
            # The main thread is blocked in the server's C++ join(): end the process from here.
            os._exit(code)
        time.sleep(POLL_S)


# ---- the chief's side ---------------------------------------------------------------------------


def run_and_tell(program: list[str]) -> int:
    """Run ``program``, then serve its result to the servers (see the module docstring); return
    its exit code (128+N for a signal N)."""
    stopped: list[int] = []
    children: list[subprocess.Popen] = []

    def pass_on(signum: int, _frame: object) -> None:
        stopped.append(signum)
        for child in children:
            child.send_signal(signum)

    # Before the child starts: as a pod's PID 1 this process ignores a signal it has no handler
    # for, and a stop must reach the program.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    children.append(subprocess.Popen(program))
    if stopped:  # a stop that came while it started
        children[0].send_signal(stopped[0])
    returncode = children[0].wait()
    code = 128 - returncode if returncode < 0 else returncode
    tf_config = os.environ.get(contract.TF_CONFIG, "{}")
    address = _address(tf_config)
    if stopped or address is None:
        return code
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # stopped while telling
        signal.signal(signum, lambda *_: sys.exit(code))
    tell(Result(uuid.uuid4().hex, code), address[1], _servers(tf_config), LINGER_S)
    return code


def tell(result: Result, port: int, servers: set[str], linger_s: float) -> set[str]:
    """Serve ``result`` on ``port`` until every one of ``servers`` has read it or ``linger_s``
    has passed; return the servers that read it."""
    told: set[str] = set()
    try:
        if socket.has_dualstack_ipv6():
            listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            listener = socket.create_server(("", port))
    except OSError as exc:
        print(f"distlaunch: cannot tell the servers the chief's result: {exc}", file=sys.stderr)
        return told
    deadline = time.monotonic() + linger_s
    with listener:
        listener.settimeout(0.2)
        while not servers <= told and time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                try:
                    conn.settimeout(LOOK_S)
                    conn.sendall(result.line())
                    told.add(conn.recv(256).split(b"\n", 1)[0].decode(errors="replace"))
                except OSError:  # a peer that is not a server, gone
                    continue
    return told & servers


def main(argv: list[str]) -> int:
    """``-- PROGRAM ARGS...``: run the chief's program and tell the servers its result."""
    if argv[:1] != ["--"] or len(argv) < 2:
        print(
            "usage: python -m distlaunch.worker.chief_result -- PROGRAM [ARGS...]",
            file=sys.stderr,
        )
        return 2
    return run_and_tell(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
