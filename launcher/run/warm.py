"""Warm standbys, tended for the loop (launcher/transports/local/standby.py makes them).

Only the loop knows when the cluster has settled and which attempt comes next: STANDBY_DELAY_S
after the last task joined, with no restart pending, the standbys are made (or remade) for the
next attempt; they go when training is done, on a stop notice (nothing restarts after one) and at
teardown. run.json's list of them follows.
"""

from __future__ import annotations

from distlaunch.launcher.plan.plan import Plan, for_attempt
from distlaunch.launcher.run.journal import Journal
from distlaunch.launcher.transports.base import StandbyPool

# How long the cluster must have been settled (every task joined) before standbys are made: their
# imports would compete for the CPU with the tasks' own start (model build, restore, first step).
STANDBY_DELAY_S = 5.0


class WarmStandbys:
    """The run's standby pool (None: the run has none), as the loop tends it."""

    def __init__(self, pool: StandbyPool | None, plan: Plan, journal: Journal) -> None:
        self.pool = pool
        self.plan = plan
        self.journal = journal
        self._made_for: int | None = None  # the attempt the standbys were last made for

    def tend(self, settled: bool, attempt: int) -> None:
        """Once ``settled`` (for STANDBY_DELAY_S), have the standbys of the attempt after
        ``attempt``; keep run.json's list current."""
        if self.pool is None:
            return
        self.pool.poll()
        if settled and self._made_for != attempt + 1:
            self._made_for = attempt + 1
            self.pool.prepare(for_attempt(self.plan, attempt + 1).tasks)
        self._record()

    def close(self) -> None:
        """No restart will come: the standbys go."""
        if self.pool is not None:
            self.pool.close()
            self._record()

    def _record(self) -> None:
        self.journal.standbys((self.pool.record() if self.pool is not None else {}) or None)
