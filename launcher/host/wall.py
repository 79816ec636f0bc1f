"""The agent's firewall job: the host's rules for the run, installed off the agent's loop.

A ``guard`` command makes the agent this host's firewall guard (`distlaunch.host.guard` has the
rules). Installing may take seconds (a name to resolve, nft, iptables waiting on its lock), so it
runs in a fork of the agent (`Install`) whose answer the loop reads when it comes, while the
loop goes on beating, relaying and watching the launcher. The fork has its own deadline,
`timeouts.FIREWALL_S`, below the launcher's silence limit: past it the agent kills the fork's
process group, answers "unprotected", and removes whatever the fork had added (in another fork:
removal, too, must not stop the loop). Whatever goes wrong in the fork is an answer, never the
agent's end.

The rules stay until the agent ends and go once the tasks' ports have closed (`Job.end`).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
import time

from distlaunch.host import guard, keepers, timeouts


class Install:
    """One firewall install in a fork of the agent: ``fd`` is readable once it answered (or died)."""

    def __init__(self, request: guard.Request) -> None:
        self.request = request
        self.deadline = time.monotonic() + timeouts.FIREWALL_S
        self.fd, self.pid = _fork(lambda: _install(request))
        self.pidfd = os.pidfd_open(self.pid)

    def answer(self) -> tuple[dict, guard.Installed | None]:
        """The fork's answer (read once ``fd`` is readable) and the rules it added, if any."""
        data = b""
        while chunk := os.read(self.fd, 65536):
            data += chunk
        self._reap()
        try:
            answer = json.loads(data)
        except ValueError:
            answer = {"protected": False, "why": "the firewall install ended without an answer"}
        undo, rules = answer.pop("undo", None), answer.pop("rules", "")
        if not answer.get("protected") or not isinstance(undo, list):
            return answer, None
        steps = tuple((tuple(argv), script) for argv, script in undo)
        return answer, guard.Installed(answer["how"], answer["table"], rules, steps)

    def overdue(self) -> dict:
        """Past the deadline: kill the fork (and the tools it ran) and remove what it added,
        in a fork of its own; the answer to send."""
        _kill_group(self.pid)
        self._reap()
        _fork(lambda: {"removed": guard.remove_leftovers(self.request.name)}, wait=False)
        return {
            "protected": False,
            "why": f"the firewall was not installed within {timeouts.FIREWALL_S:g} s",
        }

    def _reap(self) -> None:
        os.close(self.fd)
        os.close(self.pidfd)
        os.waitpid(self.pid, 0)


def _install(request: guard.Request) -> dict:
    """In the fork: resolve and install; the answer with what undoes it."""
    allowed = guard.resolve(request)
    try:
        installed = guard.install(request, allowed)
    except guard.Unprotected as exc:
        return {"protected": False, "why": str(exc)}
    return {
        "protected": True,
        "how": installed.how,
        "table": installed.name,
        "allowed": allowed,
        "rules": installed.rules,
        "undo": [[list(argv), script] for argv, script in installed.undo],
    }


def _fork(work, wait: bool = True) -> tuple[int, int]:
    """Run ``work`` in a fork of the agent, in a process group of its own (a deadline kills the
    tools it runs too); it writes ``work()``'s JSON (or why it failed) to a pipe. The read end
    and the pid; with ``wait`` False the fork is detached (a grandchild: nobody reaps it)."""
    read, write = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            keepers.leave_agent_signals()
            os.close(read)
            if not wait and os.fork():
                os._exit(0)
            os.setpgid(0, 0)
            try:
                answer = work()
            except BaseException as exc:  # noqa: BLE001 - any failure is an answer here
                answer = {"protected": False, "why": f"the firewall install failed: {exc!r}"}
            os.write(write, json.dumps(answer).encode())
        except BaseException:  # noqa: BLE001 - nothing may return into the agent's loop
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    if not wait:
        os.waitpid(pid, 0)
        os.close(read)
    return read, pid


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


class Job:
    """The agent's firewall: its install (off the loop), the starts that wait for it, the rules
    it holds and their removal once the tasks' ports have closed."""

    def __init__(self, agent, line: dict) -> None:
        self.agent = agent  # its `emit`, `sel` and `command`
        self.install: Install | None = None
        self.installed: guard.Installed | None = None
        self.request: guard.Request | None = None
        self.held: list = []  # starts and prepares that wait for the answer
        self.refused: str | None = None  # required, and not protected: why
        try:
            self.request = guard.parse(json.dumps(line).encode())
        except (ValueError, TypeError) as exc:
            self._answer({"protected": False, "why": f"bad request from the launcher: {exc}"})
            return
        try:
            self.install = Install(self.request)
        except OSError as exc:
            self._answer({"protected": False, "why": f"cannot start the install: {exc}"})
            return
        agent.sel.register(self.install.fd, selectors.EVENT_READ, ("firewall", None))

    def hold(self, command) -> bool:
        """Whether ``command`` (a start or prepare) waits for, or is refused by, the firewall."""
        if self.install is not None:
            self.held.append(command)
            return True
        if self.refused is None:
            return False
        why = f"distlaunch agent: no task starts here: {self.refused}\n".encode()
        if command.op == "start":
            self.agent.emit(b"o", command.id, why)
        self.agent.emit(b"x", command.id, b"126")
        return True

    def deadline(self) -> float | None:
        """When the install is overdue (None: none runs)."""
        return self.install.deadline if self.install is not None else None

    def answered(self) -> None:
        """The install's answer came: send it, then the starts that waited."""
        assert self.install is not None
        self.agent.sel.unregister(self.install.fd)
        answer, self.installed = self.install.answer()
        self.install = None
        self._answer(answer)

    def check_deadline(self) -> None:
        """Past FIREWALL_S: the install is killed and answered for (`Install.overdue`)."""
        if self.install is not None and time.monotonic() >= self.install.deadline:
            self.agent.sel.unregister(self.install.fd)
            answer = self.install.overdue()
            self.install = None
            self._answer(answer)

    def _answer(self, answer: dict) -> None:
        self.agent.emit(b"g", 0, json.dumps(answer).encode())
        if not answer.get("protected") and (self.request is None or self.request.required):
            self.refused = (
                'network.protect is "required" and the firewall could not be installed: '
                f"{answer.get('why', 'no reason given')}"
            )
        held, self.held = self.held, []
        for command in held:
            self.agent.command(command)

    def end(self, why: str) -> None:
        """The agent ends: an install still running is killed and undone; installed rules go
        once no task port listens (at most LINGER_S)."""
        if self.install is not None:
            _kill_group(self.install.pid)
            try:
                guard.remove_leftovers(self.install.request.name)
            except guard.Unprotected:
                pass
            self.install = None
        if self.installed is None or self.request is None:
            return
        deadline = time.monotonic() + timeouts.LINGER_S
        while guard.listening(self.request.ports) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            sys.stderr.write(
                f"distlaunch agent: {why}: removing the {self.installed.how} rules "
                f"{self.installed.name} of run {self.request.run_id}\n"
            )
            sys.stderr.flush()
        except OSError:
            pass
        installed, self.installed = self.installed, None
        installed.remove()
