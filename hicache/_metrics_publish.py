"""hicache's metrics where a multi-process server serves them (issue #33 item 6).

SGLang serves `/metrics` from its HTTP process in prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, set before its processes import prometheus_client): that
endpoint reads only the value files every process writes, so a collector in a scheduler's own
registry - where the pools live - never reaches it. Under that mode this writes the
collector's families (`hicache.metrics`, the one place values are derived) into this
process's value files through ``prometheus_client.values.ValueClass``, the store prometheus's
own Gauge and Counter write through: gauges in mode ``all`` (the MultiProcessCollector adds a
``pid`` label: one series per process, i.e. per rank), counters and the histogram with a
``pid`` label of their own (it would sum them over processes otherwise). Written at each
tracked event (by the caller, without the page tiers: see `hicache.metrics._published`), then
by one daemon thread - woken by the event, and every `PUBLISH_EVERY_S` while anything is
tracked (progressive pools move between events); outside multiprocess mode nothing here runs.
A failure is logged, never raised: a diagnostic never fails the work it observes.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("hicache.metrics")

PUBLISH_EVERY_S = 5.0  # Prometheus scrapes every 10-60 s; events are written at once anyway
GAUGE_MODE = "all"  # one series per process, pid-labelled by the MultiProcessCollector


def active() -> bool:
    """Whether prometheus_client runs in multiprocess mode in this process (its value class is
    the mmap-backed one, chosen when it was imported with PROMETHEUS_MULTIPROC_DIR set)."""
    try:
        from prometheus_client import values
    except ImportError:
        return False
    return bool(getattr(values.ValueClass, "_multiprocess", False))


class Publisher:
    """Writes families into this process's value files; remembers each value object (a file
    slot) by its key, and re-creates them all after a fork (a new pid, new files)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: dict = {}
        self.pid = os.getpid()
        self._thread = None
        self._woken = threading.Event()
        self._tickets = 0  # collects started: a write carries the number its collect began with
        self._written = -1  # the newest collect written so far
        self._stopped = False  # stop() was called: the thread ends and start() starts none

    def _slot(self, typ: str, family: str, sample: str, labels: dict, documentation: str):
        key = (typ, family, sample, tuple(labels.items()))
        slot = self.slots.get(key)
        if slot is None:
            from prometheus_client import values

            slot = values.ValueClass(typ, family, sample, tuple(labels), tuple(labels.values()), documentation,
                                     multiprocess_mode=GAUGE_MODE if typ == "gauge" else "")
            self.slots[key] = slot
        return slot

    def ticket(self) -> int:
        """The number of a collect about to start (see `write`)."""
        with self.lock:
            self._tickets += 1
            return self._tickets

    def write(self, families, ticket: int | None = None) -> None:
        """Every sample of ``families`` as this process's value now - unless they were collected
        (``ticket``) before values already written: the thread's collect can start before a
        bring-up's own write and end after it, and must not put the older values back."""
        with self.lock:
            if ticket is not None:
                if ticket < self._written:
                    return
                self._written = ticket
            if os.getpid() != self.pid:  # forked: the parent's slots point at the parent's files
                self.slots, self.pid = {}, os.getpid()
            pid = str(self.pid)
            for family in families:
                if family.type == "gauge":
                    for s in family.samples:
                        self._slot("gauge", family.name, s.name, s.labels, family.documentation).set(s.value)
                elif family.type == "counter":
                    for s in family.samples:
                        if s.name.endswith("_total"):  # not _created: the files keep values only
                            labels = {**s.labels, "pid": pid}
                            self._slot("counter", family.name, s.name, labels, family.documentation).set(s.value)
                elif family.type == "histogram":
                    self._histogram(family, pid)

    def _histogram(self, family, pid: str) -> None:
        """Buckets as the files hold them: per bucket, not cumulative (the collector adds them
        up again and derives ``_count``); ``_sum`` as it is."""
        buckets = sorted(((float(s.labels["le"]), s) for s in family.samples if s.name.endswith("_bucket")),
                         key=lambda pair: pair[0])
        below = 0.0
        for _, s in buckets:
            labels = {**s.labels, "pid": pid}
            self._slot("histogram", family.name, s.name, labels, family.documentation).set(s.value - below)
            below = s.value
        for s in family.samples:
            if s.name.endswith("_sum"):
                self._slot("histogram", family.name, s.name, {**s.labels, "pid": pid},
                           family.documentation).set(s.value)

    def start(self, collect) -> None:
        """The daemon thread that writes ``collect()`` every `PUBLISH_EVERY_S` (once per process)."""
        with self.lock:
            if self._stopped or (self._thread is not None and self._thread.is_alive() and self.pid == os.getpid()):
                return
            self._thread = threading.Thread(target=self._run, args=(collect,), name="hicache-metrics", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Have the thread write now rather than at its next `PUBLISH_EVERY_S`."""
        self._woken.set()

    def stop(self, timeout: float | None = None) -> bool:
        """End the thread and wait for it (``timeout``); True once none runs. A test's teardown:
        a server's publisher ends with its process, and one left running after its test writes
        into value files that test has closed."""
        with self.lock:
            thread, self._stopped = self._thread, True
        self._woken.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _run(self, collect) -> None:
        while True:  # a daemon: it ends with the process, or at stop()
            self._woken.wait(PUBLISH_EVERY_S)
            self._woken.clear()
            if self._stopped:
                return
            publish(self, collect)


def publish(publisher: Publisher, collect) -> None:
    """Write what ``collect()`` yields now; a failure is a log line, never the caller's."""
    try:
        ticket = publisher.ticket()
        publisher.write(list(collect()), ticket)
    except Exception:
        logger.exception("hicache metrics: could not write the multiprocess values")


PUBLISHER = Publisher()
