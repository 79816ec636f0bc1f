"""What distlaunch runs on a task's host beside the user's program: one agent per host and run
(`agent`, its jobs in `channel`, `keepers`, `standbys` and `wall`), each task's keeper (`remote`,
with `sweep` and `stacks_query`), the per-host firewall guard (`guard`, its rules in `rules`),
the timeouts both sides share (`timeouts`), the bootstrap a task's program runs under
(`bootstrap`), a pod's entry point and PID 1 (`k8s_entry`, `pod_init`).
The chief's result (`distlaunch.worker.chief_result`) stays with the runtime: a PSS server task of
the user's program watches it.

Apart from `distlaunch.worker` (the runtime a training script imports) and importing no launcher
code: a host needs the package, never the launcher's dependencies' import time.
"""
