"""The live progress line of a sweep, on stderr.

    [12/20] ok 9  failed 1  pruned 2  running 2 | best decode_step_s 3.1ms (#7) | ETA 0:41

On a terminal the line is rewritten in place; otherwise (a log file, CI) one line is
printed per finished trial. ETA = time per trial since the first one finished x trials
left, shown from the third trial that ran on: the first also pays for starting Ray and
the workers, and parallel slots finish their first trials together, so the time between
the first two is no measure of a trial (a quickstart on 2 slots read 6:51, then 0:01, for
a 40 s sweep). Pruned trials never ran and are not counted as work.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from sweeper.formatting import metric_text


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLine:
    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None,
                 already_done: int = 0, clock=time.monotonic):
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.clock = clock
        self.start = clock()
        self.already_done = already_done     # finished before this process (resume)
        self.ran = 0                         # trials this process ran to an end (not pruned)
        self._last = ""
        self._key = ""
        self._first_ran: float | None = None

    def update(self, complete: int, failed: int, pruned: int, running: int,
               best: tuple[str, float, int] | None, ran: int, force: bool = False) -> None:
        if not self.enabled:
            return
        done = complete + failed + pruned
        text = f"[{done}/{self.total}] ok {complete}  failed {failed}  pruned {pruned}"
        if running and self.tty:
            text += f"  running {running}"
        if best is not None:
            metric, value, number = best
            text += f" | best {metric} {metric_text(metric, value)} (#{number})"
        now = self.clock()
        elapsed = now - self.start
        left = self.total - done
        if ran and self._first_ran is None:
            self._first_ran = now
        if ran >= 3 and left > 0:
            # from the first finished trial on: start-up (Ray, workers, JAX) is not per-trial
            per_trial = (now - self._first_ran) / (ran - 1)
            text += f" | ETA {format_duration(per_trial * left)}"
        elif left <= 0:
            text += f" | {format_duration(elapsed)}"
        # Not a terminal: one line per finished trial, not one per second of ETA.
        key = text if self.tty else text.split(" | ETA")[0]
        if key == self._key and not force:
            return
        self._key = key
        self._last = text
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._last:
            self.stream.write("\n")
            self.stream.flush()
