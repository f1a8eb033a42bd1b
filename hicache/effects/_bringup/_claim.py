"""A bring-up's claim on the host's memory while it fills (issue #35 item 1).

The budget lock is held to decide, not to fill: `bring_up` samples the machine, takes off what
the host's claims still have to fault in, records its own claim and lets go. While its pre-fault
makes bytes resident, `ClaimedFill` raises the claim's resident count (at most every sixteenth of
the claim, never ahead of the faulted bytes, never waiting for the lock: a skipped update keeps
the bytes counted as pending a little longer - too long, never too short), so a peer sampling
mid-fill takes off exactly what is still to come and ranks pre-fault side by side; `settle`
makes it whole once all is resident. Imports nothing of effects.
"""

from __future__ import annotations

import threading

MIN_STEP_BYTES = 64 << 20  # the smallest update: a file rewrite per 64 MiB faulted, at most


class ClaimedFill:
    """``lock``: the `BudgetLock` the claim of ``total`` bytes was recorded under; call it with
    each `PrefaultEvent` (the faulting threads', serialized), then `settle()`."""

    def __init__(self, lock, total: int, *, step: int | None = None) -> None:
        # its own open file of the same lock: the faulting threads never share the bring-up
        # thread's (an interrupt there closes it under them)
        self.lock, self.total = type(lock)(lock.path.parent), total
        self.step = step if step is not None else max(total // 16, MIN_STEP_BYTES)
        self.written = 0  # of the claim, bytes the claims file counts resident
        self._mutex = threading.Lock()  # one writer of this claim at a time (the lock object is shared)

    def __call__(self, event) -> None:
        done = min(int(event.bytes_done), self.total)
        with self._mutex:
            if done - self.written < self.step and done < self.total:
                return
            if done > self.written and self.lock.try_add_resident(done - self.written):
                self.written = done

    def settle(self) -> None:
        """Every byte of the claim is resident: count it so (a short wait for the lock)."""
        with self._mutex:
            if self.written < self.total:
                with self.lock:
                    self.lock.add_resident(self.total - self.written)
                self.written = self.total
