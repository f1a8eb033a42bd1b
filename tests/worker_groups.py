"""Which xdist worker runs which tests (`make test`, `make test-loaded`): the tests that import SGLang into
the worker's own process all run on one worker, every other test goes to whichever worker is
free. SGLang's import costs about 4 s on an idle box and about 25 s beside six busy processes,
paid once by every worker that runs one such test: spread over three workers it was 78 of the
loaded run's 210 worker-seconds. On one worker: the loaded run 132 s -> 93 s, the whole suite
133 s -> 113 s (this 2-core box, 2026-12-03). (xdist's own `xdist_group` cannot do this with pytest 9.2:
xdist 3.8 renames items through `item._nodeid`, which pytest 9.2's `Node.nodeid` no longer reads.)

The controller sees only node ids, so the files are named here; tests/test_suite_rules.py checks
the list against the test files' syntax (a file that takes the `sglang` fixture or calls
`load_sglang` is named, and every name is such a file)."""

from __future__ import annotations

#: Test files whose tests import SGLang in the test process (the `sglang` fixture, load_sglang).
IN_PROCESS_SGLANG = frozenset({
    "test_plan_matches_sglang.py", "test_pool_geometry.py", "test_sglang_conformance.py",
    "test_sglang_controller.py", "test_sglang_plugin.py", "test_sglang_plugin_pools.py",
    "test_sglang_progressive.py", "test_sglang_radix.py", "test_sglang_radix_storage.py", "test_sglang_storage.py",
    "test_store_sglang.py", "test_store_sglang_edges.py",
})

#: The one work unit those files' tests form.
SGLANG_UNIT = "tests that import SGLang in-process"


def unit_of(nodeid: str) -> str:
    """The work unit of a test: SGLANG_UNIT for the files above, else the test on its own."""
    path = nodeid.split("::", 1)[0]
    return SGLANG_UNIT if path.rsplit("/", 1)[-1] in IN_PROCESS_SGLANG else nodeid


def scheduler(config, log):
    """xdist's load-by-scope scheduler with unit_of as its scope: the largest unit (the SGLang
    one) is handed out first (xdist's --loadscope-reorder, on by default), so it does not run last
    on one worker while the others idle; the rest go one test at a time to the first free worker."""
    from xdist.scheduler import LoadScopeScheduling

    class SGLangOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def remove_node(self, node):
            """xdist 3.8's, but a crashed worker's finished units and the test it died in are not
            handed out again. Requeued (pytest-xdist #1378), a finished unit reaches a worker as
            an empty one that never completes, and the run hangs at its end - here after any
            test that takes its worker down, which is what a C helper's bad access does; the
            test it died in (reported failed) would take its replacement down too (#1371)."""
            workload = self.assigned_work.pop(node)
            pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items()
                       if not done]
            if not pending:
                return None
            scope, crashed = pending[0]  # xdist's own pick: the first unit's first test not done
            workload[scope][crashed] = True
            self.workqueue.update((scope, unit) for scope, unit in workload.items() if not all(unit.values()))
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return SGLangOnOneWorker(config, log)
