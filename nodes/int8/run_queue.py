"""How long this process's threads waited for a CPU while runnable: the Linux per-thread run delay (second field of
`/proc/self/task/<tid>/schedstat`, ns), plus, in a virtual machine, CPU steal (`/proc/stat`). Such a wait is other
work's cost, not the call's: one preempted worker stalls every other at a parallel region's next barrier, so an INT8
call (several regions) pays it several times over. Steal is that wait one level down (another guest ran on the core),
which run delay misses; it comes in clock ticks (often 10 ms), so a reading says that some was stolen, not how much."""

from __future__ import annotations

import os

_TASKS = "/proc/self/task"
_STAT = "/proc/stat"
_STEAL_FIELD = 8  # of the first line: "cpu user nice system idle iowait irq softirq steal ..."


class RunQueueWait:
    """A context manager: `seconds()` is the run delay this process's threads accumulated since it was entered (an ended
    thread keeps what it added; a later one counts in full) plus the CPUs' steal since then, or None where the OS does
    not say (not Linux, no schedstat). Each thread's file stays open, so a reading costs a few microseconds a thread."""

    def __init__(self) -> None:
        self.available = False
        self._files: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._total = 0
        self._stat: int | None = None
        self._steal_start: int | None = None
        self._tick = 1e9 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 1e7

    def __enter__(self) -> RunQueueWait:
        self.available = self._read(baseline=True)
        if self.available:
            try:
                self._stat = os.open(_STAT, os.O_RDONLY)
            except OSError:
                self._stat = None
            self._steal_start = self._steal_ticks()
        return self

    def __exit__(self, *exc) -> None:
        for tid in list(self._files):
            self._forget(tid)
        if self._stat is not None:
            os.close(self._stat)
            self._stat = None

    def seconds(self) -> float | None:
        if not (self.available and self._read(baseline=False)):
            return None
        steal = self._steal_ticks()
        stolen = 0 if steal is None or self._steal_start is None else steal - self._steal_start
        return (self._total + stolen * self._tick) / 1e9

    def _steal_ticks(self) -> int | None:
        if self._stat is None:
            return None
        try:
            fields = os.pread(self._stat, 256, 0).split(b"\n", 1)[0].split()
            return int(fields[_STEAL_FIELD]) if fields[0] == b"cpu" and len(fields) > _STEAL_FIELD else None
        except (OSError, ValueError):
            return None

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
