"""`LatestCensus`: the node store's census for `get_stats` and the metrics scrape (one for both),
retaken beside SGLang's scheduler thread, never on it.

SGLang 0.5.23 calls the L3 back end's `get_stats` on every scheduler step under
--enable-metrics, and a census reads every slot's record (4-6 ms at 258,000 slots, 162-186 ms at
2.8 M). Taken on that thread, it stalled one step in every `max_age_s` by that much. Here a census
older than `max_age_s` is retaken on a thread of its own - one at a time - while the steps get the
last one at once; only the first call, with nothing older to show, waits for it. The census's
torch operations let go of the GIL, so the scheduler's own Python runs beside it.
"""

from __future__ import annotations

import logging
import threading

from hicache.errors import StoreClosedError

logger = logging.getLogger(__name__)


class LatestCensus:
    """The latest finished census of ``take`` (a store's `census`), retaken once it is
    ``max_age_s`` old on ``clock`` (the age counts from when a census started)."""

    def __init__(self, take, *, max_age_s: float, clock) -> None:
        self.take, self.max_age_s, self.clock = take, max_age_s, clock
        self._lock = threading.Lock()
        self._latest = None  # the latest finished Census
        self._tried = None  # when the latest census, finished or failed, started: one try per max_age_s
        self._running: threading.Thread | None = None

    def get(self):
        """The latest census (None if none could be taken: the store closed under it); starts a
        new one beside the caller when it is stale, waits only when there is none yet."""
        now, inline = self.clock(), False
        with self._lock:
            latest = self._latest
            if (self._tried is None or now - self._tried >= self.max_age_s) and self._running is None:
                self._tried = now
                thread = threading.Thread(target=self._refresh, daemon=True, name="hicache-store-census")
                try:
                    thread.start()
                    self._running = thread
                except RuntimeError:  # no new threads once the interpreter is exiting: count here
                    inline = True
            running = self._running
        if inline:
            self._refresh()
            latest = self._latest
        elif latest is None and running is not None:
            running.join()
            latest = self._latest
        return latest

    def expire(self) -> None:
        """The latest census is out of date (pages were cleared): the next `get` starts a new one
        (or, where one is being taken, the `get` after it finishes)."""
        with self._lock:
            self._tried = None

    def wait(self) -> None:
        """Until the census being taken now, if any, has finished."""
        running = self._running
        if running is not None:
            running.join()

    def _refresh(self) -> None:
        try:
            census = self.take()
        except StoreClosedError:
            census = None  # closed under it: get_stats reports the closed store
        except Exception as error:  # noqa: BLE001 - the scheduler's stats must not die of it
            logger.warning("node store census failed; the last one is kept: %s", error, exc_info=True)
            census = None
        with self._lock:
            if census is not None:
                self._latest = census
            self._running = None
