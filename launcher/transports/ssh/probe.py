"""Preflight probe, run on an SSH host by the host's own Python: ``python - REQUEST_JSON`` with this file on stdin
(on a Slurm node: ``python -c SOURCE REQUEST_JSON``).

It imports nothing but the standard library, so that it can report a host where distlaunch or
TensorFlow is missing instead of crashing there. It prints one JSON line:
``{"problems": [...], "ports": [...], "facts": {...}}``. The launcher never imports it.

Request keys: ``fixed_ports`` (to check free), ``auto_ports`` (how many free ports to pick),
``shared_dir`` and ``shared`` (whether the launcher's files should be visible there), ``token_file``
and ``token`` (a file the launcher just wrote in the shared dir), ``workdir``, ``script``, ``umask``,
``count_gpus``: report the host's NVIDIA GPUs as the fact ``gpus`` (the
launcher checks them against the tasks' `gpus`). ``read_cpus``: report the CPUs this host gives
the run (the probe's own affinity mask, which the tasks' helpers inherit), its NUMA nodes and its
GPUs' nodes, its cores' hyperthread siblings and its cgroup's CPU quota as the fact ``topology``
(`distlaunch.worker.topology`, `distlaunch.host.cpu_facts`: the launcher splits them
between the host's tasks).
"""

import errno
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile

TENSORFLOW_DISTS = ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-macos")


def main():
    request = json.loads(sys.argv[1])
    problems = []
    facts = {"python": platform.python_version(), "executable": sys.executable}
    check_distlaunch(problems, facts)
    check_tensorflow(problems, facts)
    if request.get("count_gpus"):
        facts["gpus"] = count_gpus()
    if request.get("read_cpus"):
        facts["topology"] = read_topology()
    if request.get("umask") is not None:
        os.umask(request["umask"])
    check_shared_dir(request, problems)
    workdir = request.get("workdir")
    if workdir and (workdir == "~" or workdir.startswith("~/")):  # as the helper reads it
        workdir = os.path.expanduser(workdir)
    if workdir and not os.path.isdir(workdir):
        problems.append(f"workdir {request['workdir']!r} is not a directory here")
    script = request.get("script")
    if script and not os.path.isfile(script):
        problems.append(
            f"script {script!r} does not exist here (a script must be at the same path on every host)"
        )
    ports = check_ports(request.get("fixed_ports", []), request.get("auto_ports", 0), problems)
    print(json.dumps({"problems": problems, "ports": ports, "facts": facts}), flush=True)


def check_distlaunch(problems, facts):
    try:
        from distlaunch.host import agent, remote
    except Exception as exc:  # noqa: BLE001 - any failure to import means the same thing here
        problems.append(
            f"{sys.executable} cannot import distlaunch.host.agent ({type(exc).__name__}: {exc}); "
            "install distlaunch in this interpreter or set the host's python"
        )
        return
    # The agent and the helper it runs each task under change together: one number for both.
    facts["protocol"] = remote.PROTOCOL if agent.PROTOCOL == remote.PROTOCOL else -1
    # Where this interpreter finds the helper: a Slurm step runs it by path (see slurm.py).
    facts["helper"] = remote.__file__
    facts["distlaunch"] = version("distlaunch") or "unknown"


def check_tensorflow(problems, facts):
    # Found, not imported: importing takes seconds and the task will import it anyway.
    if importlib.util.find_spec("tensorflow") is None:
        problems.append(f"tensorflow is not installed for {sys.executable}")
        return
    for dist in TENSORFLOW_DISTS:
        found = version(dist)
        if found is not None:
            facts["tensorflow"] = found
            return
    facts["tensorflow"] = "unknown"


def version(dist):
    """The installed version of distribution ``dist``, or None: the ``Version`` of the first
    ``*.dist-info`` (or ``*.egg-info``) of that name on sys.path, as importlib.metadata finds it.
    Read here because importing importlib.metadata (email's parser and more) costs more than the
    rest of the probe, on every host of every `up`; only a layout this does not read (a zipped
    egg, a custom finder) pays for it."""
    wanted = _normalized(dist)
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            stem, dot, kind = name.rpartition(".")
            if not dot or kind not in ("dist-info", "egg-info"):
                continue
            if _normalized(stem.partition("-")[0]) != wanted:
                continue
            found = _metadata_version(os.path.join(entry or ".", name))
            if found is not None:
                return found
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _normalized(name):
    return name.lower().replace("-", "_").replace(".", "_")


def _metadata_version(path):
    """The ``Version:`` header of a dist-info's METADATA (an egg-info's PKG-INFO, or the file
    itself), None when there is none."""
    for file in ("METADATA", "PKG-INFO", ""):
        try:
            with open(os.path.join(path, file) if file else path, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        break  # the headers end at the first empty line
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            continue
    return None


def read_topology():
    """`distlaunch.worker.topology.read()` with `distlaunch.host.cpu_facts.read()` (hyperthread
    siblings, the cgroup's CPU quota); where distlaunch is missing (a problem already reported)
    at least the affinity mask."""
    try:
        from distlaunch.host import cpu_facts
        from distlaunch.worker import topology
    except Exception:  # noqa: BLE001 - reported by check_distlaunch
        return {"cpus": sorted(os.sched_getaffinity(0)), "numa": [], "gpu_numa": []}
    return {**topology.read(), **cpu_facts.read()}


def count_gpus():
    """This host's NVIDIA GPUs: the driver's /proc entries, else the lines of `nvidia-smi -L`."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def check_shared_dir(request, problems):
    path = request["shared_dir"]
    if request["shared"]:
        token_file = request["token_file"]
        try:
            with open(token_file, encoding="utf-8") as f:
                seen = f.read()
        except OSError:
            seen = None
        if seen != request["token"]:
            problems.append(
                f"shared dir {path!r} is not shared with the launcher (its probe file is not there); "
                'mount it at the same path on every host, or set "shared_dir_is_shared": false'
            )
            return
    else:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            problems.append(f"cannot create the run files' dir {path!r}: {exc.strerror}")
            return
    try:
        fd, name = tempfile.mkstemp(dir=path, prefix=".distlaunch-write-test-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        problems.append(f"cannot write in {path!r}: {exc.strerror}")


def check_ports(fixed, auto, problems):
    """Check the fixed ports, pick ``auto`` free ones, all held at once so none is picked twice."""
    held = []
    try:
        for port in fixed:
            sockets = bind_all(port)
            if sockets is None:
                problems.append(f'port {port} is in use here; expected a free port or "auto"')
            else:
                held += sockets
        picked = []
        while len(picked) < auto:
            sockets = bind_all(0)
            if sockets is not None:
                held += sockets
                picked.append(sockets[0].getsockname()[1])
        return picked
    finally:
        for sock in held:
            sock.close()


def bind_all(port):
    """Bind ``port`` on every IPv4 and IPv6 address, as TensorFlow's server will; None if taken."""
    sockets = []
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE or family == socket.AF_INET:
                for held in sockets:
                    held.close()
                return None
            continue  # IPv6 disabled on this host: TensorFlow will not listen there either
        sockets.append(sock)
        port = sock.getsockname()[1]  # port 0: the IPv6 socket must take the same one
    return sockets


if __name__ == "__main__":
    main()
