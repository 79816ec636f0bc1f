"""Stand-in task programs: the Python source a test (or a bench script) writes as a task's program
where what it checks is the launcher's side, so that a TensorFlow start (seconds per process)
buys nothing. A stand-in listens on its own TF_CONFIG port as TensorFlow's server does (the
launcher sees it join; a firewall test can probe it), then does what its test needs.

`listening` is the prelude every stand-in starts with (or has in its middle: after its own
imports, inside an ``if``); the named pieces after it are the endings several tests share.
Bench scripts import this module as they import tests/sshhosts.py (tests/ on sys.path).
"""

from __future__ import annotations

import textwrap

ANY = "0.0.0.0"  # every interface, as TensorFlow's server binds: what peers on other hosts reach
LOOPBACK = "127.0.0.1"  # this machine (or the run's network namespace) only

# As TensorFlow's own handler does: a SIGTERM does not end the task, only the launcher's KILL.
SWALLOW_SIGTERM = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"


def listening(address: str = ANY, bind_tries: int = 1) -> str:
    """Source that listens on the task's TF_CONFIG port on ``address``: it imports json, os,
    socket, sys and time and defines ``cfg`` (TF_CONFIG), ``port`` and ``server``. SO_REUSEADDR
    as gRPC sets it: a restart binds while the last attempt's connections are in TIME_WAIT.
    ``bind_tries`` > 1: a port still held (by the last attempt, being killed on a remote host) is
    tried again every 0.1 s, that many times in all; the last failure raises."""
    if bind_tries > 1:
        bind = f"""\
for _ in range({bind_tries - 1}):
    try:
        server.bind(({address!r}, port))
        break
    except OSError:
        time.sleep(0.1)
else:
    server.bind(({address!r}, port))
"""
    else:
        bind = f"server.bind(({address!r}, port))\n"
    return (
        """\
import json, os, socket, sys, time
cfg = json.loads(os.environ["TF_CONFIG"])
port = int(cfg["cluster"][cfg["task"]["type"]][cfg["task"]["index"]].rsplit(":", 1)[1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
"""
        + bind
        + "server.listen()\n"
    )


def indented(source: str, depth: int = 1) -> str:
    """``source`` as the body of a block ``depth`` levels deep (4 spaces a level)."""
    return textwrap.indent(source, "    " * depth)


def until_exists(path: str, limit_s: float | str | None = None, poll_s: float = 0.1) -> str:
    """Source that waits until the file ``path`` (a Python expression, e.g. ``"sys.argv[1]"``)
    exists, looking every ``poll_s``; at most ``limit_s`` seconds (a number or an expression)
    when given: a test that died leaves no stand-in behind for long. Then it goes on (it exits 0
    where nothing follows)."""
    if limit_s is None:
        return f"while not os.path.exists({path}):\n    time.sleep({poll_s})\n"
    return (
        f"deadline = time.monotonic() + {limit_s}\n"
        f"while not os.path.exists({path}) and time.monotonic() < deadline:\n"
        f"    time.sleep({poll_s})\n"
    )


def listen_and_sleep(seconds: float, address: str = ANY, swallow_sigterm: bool = False) -> str:
    """A stand-in that listens, then sleeps ``seconds`` and exits 0: a task that is up until it
    is stopped (SIGTERM ends it, unless ``swallow_sigterm``: then only a KILL does, as for a
    TensorFlow program), or one that ends on its own after a short while."""
    head = SWALLOW_SIGTERM if swallow_sigterm else ""
    return head + listening(address) + f"time.sleep({seconds})\n"
