"""bench/scale_bench.py's arithmetic: the fitted growth, the targets and the overall table's rows, on
synthetic measurements (no bench is run here)."""
from __future__ import annotations

import pytest

from test_bench_summary import KEYS, _load


def _row(axis, command, size, wall, rss, cpu=None, ok=True):
    return {"axis": axis, "command": command, "size": size, "ok": ok, "error": None if ok else "exit 1: boom",
            "best_s": wall if ok else None, "cpu_s": wall if cpu is None else cpu, "rss_mib": rss,
            "read_mib": 0, "written_mib": 0, "cache": "warm", "runs_s": [wall]}


def _leaves(command, cost):
    """Three leaves sizes whose CPU time is cost(n) seconds and RSS 70 MiB + 1 KiB per leaf."""
    return [_row("leaves", command, n, wall=cost(n) + 5.0, cpu=cost(n), rss=70 + n / 1024) for n in (1_000, 3_000, 10_000)]


def test_linear_cost_meets_and_quadratic_misses():
    sb = _load("scale_bench")
    rows = _leaves("orbax inspect", lambda n: 0.2 + n * 1e-4) + _leaves("dcp inspect", lambda n: 0.2 + n * n * 1e-8)
    fits = {f["command"]: f for f in sb.fit(rows)}
    assert fits["orbax inspect"]["metric"] == "cpu_s"  # the shared machine's load (wall + 5 s) is not fitted
    assert fits["orbax inspect"]["time_per_unit_s"] == pytest.approx(1e-4)
    assert fits["orbax inspect"]["marginal_growth"] == pytest.approx(1.0)
    assert fits["dcp inspect"]["marginal_growth"] > 1.5
    assert fits["orbax inspect"]["rss_per_unit_mib"] * 1024 == pytest.approx(1.0)
    met = {q["case"]: q["met"] for q in sb.targets(rows, list(fits.values()), full=False)}
    assert met["leaves: orbax inspect: marginal time growth, 1000->10000"] is True
    assert met["leaves: dcp inspect: marginal time growth, 1000->10000"] is False
    assert met["leaves: orbax inspect: RSS per leaf"] is True
    # the largest size's inspect: wall 6.2 s (the synthetic load) against <= 2 s
    assert met["leaves: orbax inspect of 10,000 leaves: wall"] is False


def test_a_flat_start_gives_no_marginal_growth():
    sb = _load("scale_bench")
    (f,) = sb.fit(_leaves("inspect", lambda n: 0.3 if n < 10_000 else 0.5))
    assert f["marginal_growth"] is None  # the first step cost nothing: no ratio to take


def test_bytes_targets_rss_bound_and_cp_ratio():
    sb = _load("scale_bench")
    rows = []
    for gib in (0.5, 1, 2):
        rows += [_row("bytes", "convert --to dcp", gib, wall=2.0 * gib, rss=300 if gib < 2 else 700),
                 _row("bytes", "cp -r + sync", gib, wall=1.0 * gib, rss=5)]
    qs = {q["case"]: q for q in sb.targets(rows, sb.fit(rows), full=False)}
    assert qs["bytes 1 GiB: convert --to dcp: peak RSS"]["met"] is True
    assert qs["bytes 2 GiB: convert --to dcp: peak RSS"]["met"] is False  # over 512 MiB + 128 MiB
    assert qs["bytes 1 GiB: convert / (cp -r + sync)"]["value"] == 2.0
    assert qs["bytes 1 GiB: convert / (cp -r + sync)"]["met"] is False
    assert not any(case.startswith("bytes") and "cp -r + sync: peak" in case for case in qs)


def test_processes_speedup_and_a_failed_run():
    sb = _load("scale_bench")
    rows = [_row("processes", "convert --to dcp", 1, wall=10.0, rss=300),
            _row("processes", "convert --to dcp", 2, wall=5.5, rss=310),
            _row("processes", "reshard --mesh data=2,model=4", 1, wall=10.0, rss=300),
            _row("processes", "reshard --mesh data=2,model=4", 2, wall=0, rss=0, ok=False)]
    qs = {q["case"]: q for q in sb.targets(rows, sb.fit(rows), full=False)}
    assert qs["processes: convert --to dcp: 1 process / 2 processes"]["value"] == pytest.approx(1.82)
    assert qs["processes: convert --to dcp: 1 process / 2 processes"]["met"] is True
    assert qs["processes: reshard --mesh data=2,model=4: 1 process / 2 processes"]["met"] is None


def test_summary_rows_have_the_common_keys():
    sb = _load("scale_bench")
    rows = _leaves("orbax inspect", lambda n: 0.2 + n * 1e-4)
    doc = {"targets": sb.targets(rows, sb.fit(rows), full=False)}
    out = sb.summary_rows(doc)
    assert out
    for r in out:
        assert KEYS <= set(r) and r["bench"] == "scale" and r["met"] in (True, False, None)
