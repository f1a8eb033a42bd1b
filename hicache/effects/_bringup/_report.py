"""Every bring-up visible to the metrics, from the bring-up itself (issue #34 item 7): pools,
`hicache apply` and the SGLang seam pass a `Report` (the ``pool`` label and what only the
caller knows - pages, how many are ready, the NUMA node) and `bring_up` shows the handle to
`hicache.metrics` when it is up, counts a failed one, and its handle says when it is released
or hands its registration on (the seam: the tensor's owner releases it, the metrics follow the
registration). No caller pushes metrics itself any more.

A diagnostic never fails the work it observes: every call here logs what goes wrong and
returns; an interrupt still propagates. `hicache.metrics` is imported only when a bring-up
reports (it imports nothing of effects: no cycle).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import attrs

logger = logging.getLogger("hicache.metrics")


@attrs.frozen
class Report:
    """How a bring-up is reported - one value for the whole concern, so a new report adds a
    field here, not a keyword to `bring_up`. To the metrics: ``name`` (the ``pool`` label),
    ``page_num`` its pages (None: not a paged pool), ``ready_pages`` a callable giving those ready
    now (held weakly), ``numa_node`` where it is bound, ``phases`` seconds of phases the handle
    does not time; ``metrics=False``: not shown (what ``bring_up(report=None)`` means). To the
    caller: ``progress(ProgressEvent)`` after every registered call, ``prefault_progress(
    PrefaultEvent)`` after each background pre-fault piece (from the faulting threads). To a
    file: ``trace``, a Chrome trace-event JSON of this and every later bring-up of the process
    (as HICACHE_TRACE=FILE does)."""

    name: str = "bring_up"
    page_num: int | None = None
    ready_pages: Callable | None = attrs.field(default=None, eq=False)
    numa_node: int | None = None
    phases: dict = attrs.field(factory=dict, eq=False)
    metrics: bool = True
    progress: Callable | None = attrs.field(default=None, eq=False)
    prefault_progress: Callable | None = attrs.field(default=None, eq=False)
    trace: str | None = None


def _shown(report) -> bool:
    return report is not None and report.metrics


def _metrics():
    from hicache import metrics

    return metrics if metrics.available() else None


def shown(report: Report | None, handle) -> None:
    """``handle`` is up: the metrics report it as ``report.name`` from now on."""
    if not _shown(report):
        return
    try:
        if (metrics := _metrics()) is not None:
            metrics.track(report.name, handle, numa_node=report.numa_node, page_num=report.page_num,
                          ready_pages=report.ready_pages, phases=report.phases)
    except Exception:
        logger.exception("hicache metrics: could not show the bring-up of %s", report.name)


def failed(report: Report | None) -> None:
    """The bring-up failed and was rolled back: one failed bring-up of ``report.name``."""
    if not _shown(report):
        return
    try:
        if (metrics := _metrics()) is not None:
            metrics.failed(report.name)
    except Exception:
        logger.exception("hicache metrics: could not count the failed bring-up of %s", report.name)


def released(report: Report | None, handle=None) -> None:
    """``handle`` gave everything back: nothing held from now on (its calls stay counted)."""
    if not _shown(report):
        return
    try:
        if (metrics := _metrics()) is not None:
            metrics.released(report.name, handle)
    except Exception:
        logger.exception("hicache metrics: could not report the release of %s", report.name)


def before_detach(report: Report | None, handle):
    """What the metrics need of a handle about to hand its registration on (read while it still
    holds its tensors): timings, allocator, bytes, and the page tiers as a reader the scrape
    calls - not read here: reading /proc/self/smaps walks every page table of the process, 53-60
    ms inside each SGLang pool's constructor with SGLang loaded (15% of a 2 GiB bring-up); None
    when nothing reports."""
    if not _shown(report):
        return None
    try:
        if _metrics() is None:
            return None
        from hicache.effects._host._tiers import buffer_tiers

        spans = tuple(handle.buffer_spans())  # addresses only: the reader keeps no memory alive
        return {"timings": dict(handle.timings), "allocator": handle.allocator, "total_bytes": handle.total_bytes,
                "tiers": functools.partial(buffer_tiers, spans)}
    except Exception:
        logger.exception("hicache metrics: could not read %s before it hands its registration on", report.name)
        return None


def detached(report: Report | None, registration, snapshot) -> None:
    """The registration now belongs to the tensor's owner: the metrics follow it (held by the
    registration itself, so they live exactly as long as it does)."""
    if not _shown(report) or snapshot is None or registration is None:
        return
    try:
        if (metrics := _metrics()) is not None:
            registration.reported = metrics.track_registration(report.name, registration, page_num=report.page_num,
                                                               **snapshot)
    except Exception:
        logger.exception("hicache metrics: could not follow the registration of %s", report.name)

