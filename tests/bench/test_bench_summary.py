"""bench/run_all.py's overall table: each bench's summary_rows() on JSON of its real form, and the renderer.

The documents below are trimmed copies of what each bench printed with --json (2026-12-01 runs);
no bench is run here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def _load(name: str):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _res(name, command, best_s, rss_kib, ok=True, error=None, **kw):
    return {"name": name, "command": command, "ok": ok, "error": error, "best_s": best_s,
            "peak_rss_kib": rss_kib, "check_errors": [], "notes": [], **kw}


INSPECT = {
    "bench": "inspect", "leaves": 3000, "runs": 1, "ok": True,
    "results": [
        _res("ckpt-orbax", "ckpt inspect --json <orbax>", 0.491, 81444, format="orbax", role="ckpt"),
        _res("orbax", "ocp.StandardCheckpointer().metadata()", 3.6047, 250000, format="orbax", role="baseline"),
        _res("ckpt-dcp", "ckpt inspect --json <dcp>", 0.5614, 70656, format="dcp", role="ckpt"),
        _res("torch-dcp", "FileSystemReader().read_metadata()", 4.4961, 280000, format="dcp", role="baseline"),
    ],
    "ratios": [
        {"format": "orbax", "baseline": "orbax", "ckpt": "ckpt-orbax", "ratio": 7.34, "target": 10.0, "met": False},
        {"format": "dcp", "baseline": "torch-dcp", "ckpt": "ckpt-dcp", "ratio": 12.0, "target": 10.0, "met": True},
    ],
}

VALIDATE = {
    "bench": "validate", "leaves": 3000, "deep_bytes": 2**31, "runs": 1, "ok": True,
    "results": [
        _res("ckpt-orbax-shallow", "ckpt validate --json <orbax_3000>", 0.6182, 87920),
        _res("list-orbax", "ts ocdbt list + file list <orbax_3000>", 0.2943, 59640),
        _res("ckpt-orbax-deep", "ckpt validate --deep --json <orbax_2gib>", 8.6299, 282376),
        _res("read-orbax", "ts zarr/ocdbt read, 4 threads <orbax_2gib>", 7.3037, 248324),
    ],
    "ratios": [
        {"format": "orbax", "mode": "shallow", "ckpt": "ckpt-orbax-shallow", "baseline": "list-orbax", "ratio": 2.1,
         "target": 2.0, "met": False, "ckpt_peak_rss_kib": 87920},
        {"format": "orbax", "mode": "deep", "ckpt": "ckpt-orbax-deep", "baseline": "read-orbax", "ratio": 1.18,
         "target": None, "met": None, "ckpt_peak_rss_kib": 282376, "ckpt_gib_per_s": 0.232, "baseline_gib_per_s": 0.274},
    ],
}

CONVERT = {
    "bench": "convert", "bytes": 2**31, "arrays": 64, "runs": 1, "settle_s": 5.0, "ok": True,
    "results": [
        _res("ckpt-to-dcp-w4", "ckpt convert --to dcp --workers 4 (default)", 3.5108, 281272),
        _res("orbax-restore-dcp-save", "orbax restore (numpy) + torch.from_numpy + dcp.save", 14.5901, 3455000),
        _res("cp-orbax", "cp -r SRC DST", 0.8801, 18908),
    ],
    "targets": [
        {"direction": "orbax->dcp", "ckpt": "ckpt-to-dcp-w4", "workers": 4, "what": "baseline/ckpt",
         "other": "orbax-restore-dcp-save", "value": 4.16, "target": 3.0, "op": ">=", "met": True},
        {"direction": "orbax->dcp", "ckpt": "ckpt-to-dcp-w4", "workers": 4, "what": "ckpt/cp", "other": "cp-orbax",
         "value": 3.99, "target": 3.0, "op": "<=", "met": False},
        {"direction": "orbax->dcp", "ckpt": "ckpt-to-dcp-w4", "workers": 4, "what": "ckpt_rss_mib", "other": None,
         "value": 275, "target": 512.0, "op": "<=", "met": True},
    ],
    "info": [{"direction": "orbax->dcp", "ckpt": "ckpt-to-dcp-w4", "workers": 4, "what": "ckpt/cp-fsync",
              "other": "cp-fsync-orbax", "value": 1.96}],
    "profiles": None,
}

SAFETENSORS = {
    "bench": "safetensors", "bytes": 2**31, "arrays": 64, "runs": 1, "settle_s": 5.0, "ok": False,
    "results": [
        _res("ckpt-dcp-to-safetensors", "ckpt convert --to safetensors (default --workers 4)", None, None,
             ok=False, error="exit 2: error: boom"),
        _res("dcp-baseline", "dcp_to_torch_save + torch.load + safetensors.torch.save_file", 20.6267, 2407568),
        _res("cp-dcp", "cp -r SRC DST", 0.8428, 17576),
    ],
    "targets": [
        {"direction": "dcp->safetensors", "ckpt": "ckpt-dcp-to-safetensors", "workers": 4, "what": "baseline/ckpt",
         "other": "dcp-baseline", "value": None, "target": 3.0, "op": ">=", "met": None},
        {"direction": "dcp->safetensors", "ckpt": "ckpt-dcp-to-safetensors", "workers": 4, "what": "ckpt/cp",
         "other": "cp-dcp", "value": None, "target": 3.0, "op": "<=", "met": None},
        {"direction": "dcp->safetensors", "ckpt": "ckpt-dcp-to-safetensors", "workers": 4, "what": "ckpt_rss_mib",
         "other": None, "value": None, "target": 512.0, "op": "<=", "met": None},
    ],
}

RESHARD = {
    "bench": "reshard", "bytes": 2**31, "arrays": 64, "runs": 1, "ok": True,
    "cases": {"2x4": {"mesh": "data=2,model=4", "spec": ["data", "model"], "shard": [2048, 512]},
              "model8": {"mesh": "model=8", "spec": [None, "model"], "shard": [4096, 256]}},
    "results": [
        _res("ckpt-reshard-2x4", "ckpt reshard --mesh data=2,model=4 --devices 8 --json", 4.8645, 423564, case="2x4"),
        _res("orbax-restore-save-2x4", "orbax restore onto the new mesh + save", 10.1908, 4634428, case="2x4"),
        _res("ckpt-reshard-model8", "ckpt reshard --mesh model=8 --devices 8 --json", 5.0, 400000, case="model8"),
        _res("orbax-restore-save-model8", "orbax restore onto the new mesh + save", 9.0, 4000000, case="model8"),
    ],
    "targets": [
        {"case": "2x4", "mesh": "data=2,model=4", "what": "baseline/ckpt", "value": 2.09, "target": 2.0, "op": ">=",
         "met": True},
        {"case": "2x4", "mesh": "data=2,model=4", "what": "ckpt_rss_mib", "value": 414, "target": 512.0, "op": "<=",
         "met": True},
    ],
    "info": [{"case": "model8", "mesh": "model=8", "what": "baseline/ckpt", "value": 1.8},
             {"case": "model8", "mesh": "model=8", "what": "ckpt_rss_mib", "value": 391}],
    "profiles": None,
}

SHAPES = {"load": 1.2, "results": [
    {"shape": "wide", "what": "validate --deep", "ckpt_s": 2.2457, "ckpt_rc": 0, "ckpt_rss_kib": 151280,
     "baseline_s": 5.0984, "baseline_rc": 0, "baseline_rss_kib": 79540, "ratio": 0.4405, "target": "<= 1.5x",
     "met": True, "rss_met": True, "budget": 536870912, "error": "", "note": ""},
    {"shape": "big_chunks", "what": "reshard data=2,model=4", "ckpt_s": 40.0, "ckpt_rc": 0, "ckpt_rss_kib": 700000,
     "baseline_s": None, "baseline_rc": None, "baseline_rss_kib": None, "ratio": None, "target": ">= 2.0x",
     "met": None, "rss_met": False, "budget": 536870912, "error": "",
     "note": "skipped: not enough free memory for the baseline"},
]}

RUNS = {"bench": "runs", "steps": 200, "files": {"dcp": 401, "orbax": 2201}, "runs": 5, "target_s": 1.0,
        "floor": {"best_s": 0.8}, "met": False, "ok": False, "results": [
            {"name": "dcp local ls", "best_s": 0.77, "peak_rss_kib": 64000, "error": None, "check_errors": []},
            {"name": "dcp s3 ls", "best_s": 1.2, "peak_rss_kib": 68000, "error": None, "check_errors": []},
            {"name": "orbax s3 latest", "best_s": None, "peak_rss_kib": None, "error": "exit 1: boom", "check_errors": []},
        ]}

# remote_bench's targets, from its 8 GiB run of 2026-12-06 (one round)
REMOTE = {"bench": "remote", "sizes": [], "targets": [
    {"case": "8 GiB validate --deep / floor", "values": [1.01], "target": 1.5, "met": True, "ckpt_s": 32.16,
     "baseline_s": 31.72, "rss_mib": 293.0},
    {"case": "8 GiB convert gs:// -> local dcp / floor", "values": [1.70, 1.2], "target": 1.5, "met": False,
     "ckpt_s": 49.24, "baseline_s": 29.03, "rss_mib": 363.0},
    {"case": "8 GiB peak RSS of the gs:// commands - local convert's (MiB)", "values": [180.37], "target": 256,
     "met": True, "ckpt_s": None, "baseline_s": None, "rss_mib": 363.0},
]}

DOCS = {"inspect": INSPECT, "validate": VALIDATE, "convert": CONVERT, "safetensors": SAFETENSORS,
        "reshard": RESHARD, "shapes": SHAPES, "runs": RUNS, "remote": REMOTE}
KEYS = {"bench", "case", "ckpt_s", "baseline", "baseline_s", "ratio", "target", "met", "rss_mib"}


@pytest.mark.parametrize("name", sorted(DOCS))
def test_rows_have_the_common_keys(name):
    rows = _load(f"{name}_bench").summary_rows(DOCS[name])
    assert rows
    for r in rows:
        assert KEYS <= set(r), r
        assert r["bench"] == name
        assert r["met"] in (True, False, None)


def test_remote_rows_give_the_worst_round():
    rows = _load("remote_bench").summary_rows(REMOTE)
    assert [(r["case"], r["ratio"], r["met"]) for r in rows] == [
        ("8 GiB validate --deep / floor", 1.01, True),
        ("8 GiB convert gs:// -> local dcp / floor", 1.70, False),  # every round counts, not the median
        ("8 GiB peak RSS of the gs:// commands - local convert's (MiB)", 180.37, True)]


def test_inspect_rows():
    rows = _load("inspect_bench").summary_rows(INSPECT)
    assert [(r["case"], r["ckpt_s"], r["baseline_s"], r["ratio"], r["met"], r["rss_mib"]) for r in rows] == [
        ("3,000 leaves, orbax", 0.491, 3.6047, 7.34, False, 80),
        ("3,000 leaves, dcp", 0.5614, 4.4961, 12.0, True, 69)]
    assert rows[0]["baseline"] == "ocp.StandardCheckpointer().metadata()"
    assert rows[0]["target"] == "baseline/ckpt >= 10x"


def test_validate_rows():
    shallow, deep = _load("validate_bench").summary_rows(VALIDATE)
    assert (shallow["case"], shallow["ratio"], shallow["target"], shallow["met"]) == (
        "shallow, 3,000 leaves, orbax", 2.1, "ckpt/baseline <= 2x", False)
    assert (deep["case"], deep["ckpt_s"], deep["baseline_s"], deep["target"], deep["met"], deep["rss_mib"]) == (
        "--deep, 2 GiB, orbax", 8.6299, 7.3037, None, None, 276)


def test_convert_rows_one_per_ratio_target_rss_with_each():
    rows = _load("convert_bench").summary_rows(CONVERT)
    assert [(r["baseline"], r["ratio"], r["target"], r["met"]) for r in rows] == [
        ("orbax restore (numpy) + torch.from_numpy + dcp.save", 4.16, "baseline/ckpt >= 3x", True),
        ("cp -r SRC DST", 3.99, "ckpt/cp <= 3x", False)]
    for r in rows:
        assert (r["case"], r["ckpt_s"], r["rss_mib"], r["rss_target"], r["rss_met"]) == (
            "orbax -> dcp, 2 GiB", 3.5108, 275, "<= 512 MiB", True)


def test_safetensors_failed_command_shows():
    rows = _load("safetensors_bench").summary_rows(SAFETENSORS)
    assert len(rows) == 2 and all(r["bench"] == "safetensors" for r in rows)
    assert all(r["ckpt_s"] is None and r["met"] is None and "boom" in r["error"] for r in rows)
    table = _load("run_all").render_table(rows)
    assert "FAILED: exit 2: error: boom" in table and "not measured" in table


def test_reshard_rows_with_and_without_target():
    target, other = _load("reshard_bench").summary_rows(RESHARD)
    assert (target["case"], target["ratio"], target["target"], target["met"], target["rss_mib"], target["rss_met"]) == (
        "--mesh data=2,model=4, 2 GiB", 2.09, "baseline/ckpt >= 2x", True, 414, True)
    assert (other["case"], other["ratio"], other["target"], other["met"], other["rss_mib"], other["rss_target"]) == (
        "--mesh model=8, 2 GiB", 1.8, None, None, 391, None)


def test_shapes_rows():
    wide, big = _load("shapes_bench").summary_rows(SHAPES)
    assert (wide["case"], wide["ratio"], wide["target"], wide["met"], wide["rss_mib"], wide["rss_target"]) == (
        "wide: validate --deep", 0.4405, "ckpt/baseline <= 1.5x", True, 148, "<= 640 MiB")
    assert wide["baseline"] == "tensorstore reading every array once"
    assert (big["baseline_s"], big["target"], big["met"], big["rss_met"]) == (None, "baseline/ckpt >= 2.0x", None, False)
    line = _load("run_all").render_table([big]).splitlines()[2]
    assert "skipped: not enough free memory" in line and "OVER" in line


def test_run_all_table_and_failure_rows():
    ra = _load("run_all")
    rows = []
    for name, doc in DOCS.items():
        rows += ra.bench_rows(name, _load(f"{name}_bench"), json.loads(json.dumps(doc)), 0, "")
    rows += ra.bench_rows("broken", None, None, 1, "some text\nValueError: bad")
    rows += ra.bench_rows("inspect", _load("inspect_bench"), INSPECT, 1, "")  # rows, but the bench exited 1
    rows += ra.bench_rows("nojson", _load("inspect_bench"), {"results": [], "ratios": []}, 0, "")
    lines = ra.render_table(rows).splitlines()
    assert lines[0] == "| bench | case | ckpt | baseline (what) | ratio | target | met | ckpt peak RSS |"
    body = [ln for ln in lines[2:] if ln.startswith("| ")]
    assert len(body) == len(rows) == 2 + 2 + 2 + 2 + 2 + 2 + 3 + 3 + 1 + 3 + 1
    assert all(ln.count(" | ") == 7 for ln in body), body  # a '|' in a cell is escaped
    assert "| inspect | 3,000 leaves, orbax | 0.49 s | 3.60 s (ocp.StandardCheckpointer().metadata()) | 7.34x | " \
           "baseline/ckpt >= 10x | MISSED | 80 MiB |" in lines
    assert "| convert | orbax -> dcp, 2 GiB | 3.51 s | 0.88 s (cp -r SRC DST) | 3.99x | ckpt/cp <= 3x | MISSED | " \
           "275 MiB (<= 512 MiB: met) |" in lines
    assert any("| broken | FAILED: exit 1, no JSON on stdout (ValueError: bad) |" in ln for ln in body)
    assert any("| inspect | FAILED: exit 1 (see its table above) |" in ln for ln in body)
    assert any("| nojson | exit 0: no rows in its JSON |" in ln for ln in body)
    assert json.loads(json.dumps(rows)) == rows  # summary.json holds them as they are


def test_summary_rows_error_becomes_a_row():
    ra = _load("run_all")
    (row,) = ra.bench_rows("inspect", _load("inspect_bench"), {"ratios": [{"nope": 1}]}, 0, "")
    assert row["bench"] == "inspect" and "summary_rows() failed: KeyError" in row["case"]


def test_runs_rows_target_only_ls_on_the_dcp_root():
    local, s3, failed = _load("runs_bench").summary_rows(RUNS)
    assert local["case"] == "ckpt ls, dcp root of 200 steps (401 files), local"
    assert (local["target"], local["met"], local["ratio"]) == ("< 1 s", True, 0.96)
    assert (s3["met"], s3["baseline"]) == (False, "ckpt inspect dcp_single")
    assert failed["target"] is None and failed["met"] is None and failed["error"] == "exit 1: boom"


CLI_START = {
    "bench": "cli_start", "runs": 20, "ok": True, "ratio": 1.05, "target": 1.5, "help_met": True, "met": False,
    "help_heavy_imports": [], "help_modules": 35,
    "results": [
        _res("python", "python -c pass", 0.020, 16000, median_s=0.024),
        _res("version", "ckpt --version", 0.023, 16500, median_s=0.027),
        _res("help", "ckpt --help", 0.024, 16600, median_s=0.040),
    ],
    "vs_python": [
        {"name": "version", "command": "ckpt --version", "ratio": 1.12, "target": 1.5, "met": True},
        {"name": "help", "command": "ckpt --help", "ratio": 1.67, "target": 1.5, "met": False},
    ],
}


def test_cli_start_rows_against_a_bare_interpreter_by_medians():
    rows = _load("cli_start_bench").summary_rows(CLI_START)
    assert [(r["case"], r["ckpt_s"], r["baseline"], r["baseline_s"], r["ratio"], r["target"], r["met"]) for r in rows] == [
        ("ckpt --version (console script)", 0.027, "python -c pass", 0.024, 1.12, "ckpt/baseline <= 1.5x", True),
        ("ckpt --help (console script)", 0.040, "python -c pass", 0.024, 1.67, "ckpt/baseline <= 1.5x", False),
        ("ckpt --help", 0.040, "ckpt --version", 0.027, 1.05, "ckpt/baseline <= 1.5x", True)]


def test_inspect_rows_are_the_medians_where_kept():
    doc = json.loads(json.dumps(INSPECT))
    doc["results"][0]["median_s"] = 0.5
    doc["ratios"].append({"format": "dcp", "baseline": "torch-dcp", "ckpt": "ckpt-dcp", "leaves": 30000, "ratio": 6.5,
                          "target": 6.0, "met": True})
    rows = _load("inspect_bench").summary_rows(doc)
    assert rows[0]["ckpt_s"] == 0.5 and rows[1]["ckpt_s"] == 0.5614
    assert (rows[2]["case"], rows[2]["target"], rows[2]["met"]) == ("30,000 leaves, dcp", "baseline/ckpt >= 6x", True)


def test_inspect_bench_times_one_format_alone():
    ib = _load("inspect_bench")
    dcp = ib.commands({"dcp": "d", "dcp_big": "D"})
    assert [c["name"] for c in dcp] == ["ckpt-dcp-big", "torch-dcp-big", "ckpt-dcp", "torch-dcp"]
    both = ib.commands({"orbax": "o", "dcp": "d", "dcp_big": "D"})
    assert [c["name"] for c in both] == ["ckpt-dcp-big", "torch-dcp-big", "ckpt-orbax", "orbax", "ckpt-dcp", "torch-dcp"]
