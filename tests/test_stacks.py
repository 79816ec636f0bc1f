"""Reading py-spy dumps: threads, frames, and where a task waits (scripted dumps, no processes)."""

from __future__ import annotations

import pytest

from distlaunch.launcher.diagnosis import evidence, stacks

pytestmark = pytest.mark.quick

WAITING = """Process 3052: python task.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 3052 (idle): "MainThread"
    syscall (libc.so.6)
    absl::Notification::WaitForNotification (tensorflow/libtensorflow_framework.so.2)
    quick_execute (tensorflow/python/eager/execute.py:53)
    Function.__call__ (tensorflow/python/eager/polymorphic_function/polymorphic_function.py:833)
    train (task.py:23)
    <module> (task.py:27)
Thread 3099 (idle): "grpc"
    epoll_wait (libc.so.6)
"""
SLEEPING = """Thread 3053 (idle): "MainThread"
    clock_nanosleep (libc.so.6)
    time_sleep (libpython3.11.so.1.0)
    train (task.py:22)
    <module> (task.py:27)
"""


def test_parse_keeps_threads_and_frames_innermost_first():
    threads = stacks.parse(WAITING)
    assert [t.name for t in threads] == ["MainThread", "grpc"]
    assert threads[0].frames[0].native and threads[0].frames[2].line == 53
    assert str(threads[0].frames[4]) == "train (task.py:23)"


def test_where_names_the_user_frame_and_the_tensorflow_wait():
    waiting = stacks.where(stacks.parse(WAITING))
    assert (
        waiting.line()
        == "waits in a TensorFlow function (graph execution), called from train (task.py:23)"
    )
    sleeping = stacks.where(stacks.parse(SLEEPING))
    assert sleeping.line() == "in its own code at train (task.py:22)"


def test_the_hung_task_is_the_one_in_its_own_code(tmp_path):
    captures = [
        stacks.record(tmp_path, "worker-0", WAITING),
        stacks.record(tmp_path, "worker-1", SLEEPING),
    ]
    assert [c.task for c in stacks.hung(captures)] == ["worker-1"]
    assert stacks.summary(captures, silent=True)[0].startswith("hung: worker-1: in its own code")
    assert not any(line.startswith("hung") for line in stacks.summary(captures))
    # Every task waits in TensorFlow: nobody is named hung.
    both = [captures[0], stacks.record(tmp_path, "worker-2", WAITING)]
    assert stacks.hung(both) == []


def test_follow_on_errors_are_peer_lost_and_fingerprints_ignore_numbers():
    lost = evidence.from_log(
        'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n'
        "tensorflow.python.framework.errors_impl.UnavailableError: socket closed\n"
    )
    assert evidence.peer_lost(lost)
    own = evidence.from_log(
        'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n'
        "ValueError: bad value 42\n"
    )
    assert not evidence.peer_lost(own)
    again = evidence.from_log(
        'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n'
        "ValueError: bad value 43\n"
    )
    assert evidence.fingerprint(own) == evidence.fingerprint(again)


def test_the_tasks_a_follow_on_error_names_as_lost():
    lost = evidence.from_log(
        "Traceback (most recent call last):\n"
        '  File "t.py", line 3, in <module>\n'
        "tensorflow.python.framework.errors_impl.UnavailableError: Graph execution error:\n"
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks"
        " are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\n"
        "The tasks have crashed.\n"
    )
    assert evidence.peer_lost(lost) and evidence.lost_tasks(lost) == ("worker-1",)
