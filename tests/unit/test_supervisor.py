"""``shared.supervisor``: a child that exits is restarted after its backoff, and its exit hook runs
once per exit, before the restart (real child processes)."""

from __future__ import annotations

import time

from shared.supervisor import MIN_BACKOFF_S, Supervisor


def test_the_exit_hook_runs_once_per_exit_before_the_restart():
    events: list[str] = []
    supervisor = Supervisor(log=events.append)
    # A module that does not exist: the child exits with code 1 at once.
    child = supervisor.start("gone", "cleave_no_such_module_for_the_supervisor_test", [])
    child.on_exit = lambda: events.append("hook")
    try:
        for exit_number in (1, 2):
            assert child.proc is not None
            child.proc.wait(timeout=60)
            now = time.monotonic()
            supervisor.poll(now)
            supervisor.poll(now)  # noticed once: the hook does not run again
            assert events.count("hook") == exit_number and child.restarts == exit_number - 1
            assert events[-1] == "hook" and events[-2].startswith("child_exited name=gone code=1")
            supervisor.poll(now + MIN_BACKOFF_S * 2**exit_number)  # past the backoff: restarted
            assert child.restarts == exit_number and events[-1].startswith("child_restarted name=gone")
        child.on_exit = lambda: 1 / 0  # a failing hook is logged; supervision goes on
        assert child.proc is not None
        child.proc.wait(timeout=60)
        supervisor.poll()
        assert events[-1].startswith("child_exit_hook_failed name=gone") and "ZeroDivisionError" in events[-1]
    finally:
        supervisor.stop()
