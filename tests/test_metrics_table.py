"""The metrics are one table (issue #34 item 7): docs/metrics.md lists exactly the rows of
`hicache._metrics_rows` - names (a counter with prometheus' ``_total``), types and labels - and
the collector makes one family per row, in the table's order, from one read of a scrape."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache._metrics_rows import COUNTER, POOL_METRICS, STORE_METRICS, PoolScrape, families

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def _documented() -> dict[str, tuple[str, tuple]]:
    """name -> (type, label names) of every table row of docs/metrics.md (labels: the backticked
    names outside parentheses)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`hicache_"):
            labels = re.sub(r"\([^)]*\)", "", cells[2])
            rows[cells[0].strip("`")] = (cells[1], tuple(re.findall(r"`([a-z_]+)`", labels)))
    return rows


def _exposed(row) -> str:
    return row.name + "_total" if row.kind == COUNTER else row.name


def test_the_docs_list_exactly_the_tables_rows():
    """Every row is documented with its type and labels, and the docs list no metric the table lacks."""
    documented = _documented()
    table = {_exposed(row): (row.kind, tuple(row.labels)) for row in (*POOL_METRICS, *STORE_METRICS)}
    assert documented == table


def test_the_doc_parser_sees_the_rows():
    """Not vacuous: the parser finds both tables' rows."""
    assert len(_documented()) == len(POOL_METRICS) + len(STORE_METRICS) >= 20


def test_the_collector_makes_one_family_per_row_in_order():
    """An empty scrape still gives every family (the rows' names, types, help), in the table's order."""
    pytest.importorskip("prometheus_client")
    scrape = PoolScrape(pools=(), calls={("p", "failed"): 2}, claims={7: 10}, rates=(1.0, 2.0),
                        waits={"buckets": [(0.001, 1), (float("inf"), 3)], "sum": 0.5})
    made = families(POOL_METRICS, scrape) + families(STORE_METRICS, [])
    assert [(f.name, f.type, f.documentation) for f in made] == \
        [(row.name, row.kind, row.help) for row in (*POOL_METRICS, *STORE_METRICS)]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in made for s in f.samples}
    assert samples[("hicache_registration_calls_total", (("pool", "p"), ("result", "failed")))] == 2
    assert samples[("hicache_budget_bytes", (("holder", "pid:7"),))] == 10
    assert samples[("hicache_turnstile_wait_seconds_count", ())] == 3
