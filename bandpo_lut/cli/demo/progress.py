"""Progress lines of a long demo run, on stderr (stdout keeps the table and summary lines that scripts parse): one
line per finished (method, seed) run with the time it took and an estimate of the time left."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, stream=None):
        self.total = total
        self.done = 0
        self.stream = stream
        self.start = time.perf_counter()
        self.last = self.start

    def step(self, what: str) -> None:
        """Report that one of the `total` runs, described by `what`, has finished."""
        now = time.perf_counter()
        self.done += 1
        left = (now - self.start) / self.done * (self.total - self.done)
        stream = self.stream or sys.stderr   # looked up at each call: pytest's capture replaces sys.stderr
        print(f"  [{self.done}/{self.total}] {what} done in {now - self.last:.1f} s"
              + (f" (about {left:.0f} s left)" if self.done < self.total else ""), file=stream, flush=True)
        self.last = now
