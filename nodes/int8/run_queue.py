"""How long this process's threads have waited for a CPU while runnable: the Linux scheduler's per-thread run
delay (`/proc/self/task/<tid>/schedstat`, second field, in nanoseconds).

A timed call whose threads waited for a CPU was slowed by other work on the machine, not by its own cost: one
preempted worker stalls every other at the next barrier of a parallel region, so a call of several regions (an
INT8 call) pays it several times over.
"""

from __future__ import annotations

import os

_TASKS = "/proc/self/task"


class RunQueueWait:
    """A counter, used as a context manager: `seconds()` is the run delay this process's threads accumulated since
    it was opened (a thread that ends keeps what it added; one that starts later counts in full), or None where the
    OS does not say (not Linux, no schedstat). Each thread's file stays open while it is, so a reading costs a few
    microseconds a thread."""

    def __init__(self) -> None:
        self.available = False
        self._files: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._total = 0

    def __enter__(self) -> RunQueueWait:
        self.available = self._read(baseline=True)
        return self

    def __exit__(self, *exc) -> None:
        for tid in list(self._files):
            self._forget(tid)

    def seconds(self) -> float | None:
        if not (self.available and self._read(baseline=False)):
            return None
        return self._total / 1e9

    def _read(self, baseline: bool) -> bool:
        try:
            tids = set(os.listdir(_TASKS))
        except OSError:
            return False
        for tid in set(self._files) - tids:
            self._forget(tid)
        for tid in tids:
            try:
                if tid not in self._files:
                    self._files[tid] = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY)
                delay = int(os.pread(self._files[tid], 128, 0).split()[1])
            except (OSError, IndexError, ValueError):  # the thread ended since the listing
                self._forget(tid)
                continue
            self._total += delay - self._last.get(tid, delay if baseline else 0)
            self._last[tid] = delay
        return bool(self._files)

    def _forget(self, tid: str) -> None:
        fd = self._files.pop(tid, None)
        if fd is not None:
            os.close(fd)
        self._last.pop(tid, None)
