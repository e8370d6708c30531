"""The command line's contract with scripts and newcomers: exit codes, one usage-error style,
`--json` errors, help texts, plurals, plain output in a pipe (issue 18, items 9, 11, 15).

Every command runs as a whole process (`python -m ckpt_tool`), as a script would run it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, fixture_path, run_ckpt

ORBAX = str(fixture_path("orbax_ocdbt_zarr2"))
ROOT_DIR = str(fixture_path("orbax_manager"))  # a CheckpointManager root
FLAX_ROOT = str(fixture_path("flax_msgpack"))
LLAMA = str(fixture_path("safetensors_llama_sharded"))
DCP = str(fixture_path("dcp_single"))


def _usage_lines(command: str, message: str) -> list[str]:
    """What click prints for a usage error: the one style every usage error has."""
    usage = {
        "inspect": "Usage: ckpt inspect [OPTIONS] PATH",
        "validate": "Usage: ckpt validate [OPTIONS] PATH",
        "diff": "Usage: ckpt diff [OPTIONS] A [B]",
        "convert": "Usage: ckpt convert [OPTIONS] SRC DST",
        "reshard": "Usage: ckpt reshard [OPTIONS] SRC DST",
    }[command]
    return [usage, f"Try 'ckpt {command} --help' for help.", "", f"Error: {message}"]


# -- exit code 0: ok ----------------------------------------------------------------


@pytest.mark.slow
def test_exit_0_ok():
    for args in (["inspect", ORBAX], ["validate", DCP], ["diff", ORBAX, ORBAX], ["--help"], ["--version"]):
        r = run_ckpt(*args)
        assert r.returncode == 0, (args, r.stderr)
        assert r.stderr == "", (args, r.stderr)


# -- exit code 1: the checkpoint has a problem, or a diff differs -------------------


@pytest.mark.slow
def test_exit_1_checkpoint_problem_one_line(tmp_path):
    r = run_ckpt("inspect", str(tmp_path / "nope"))
    assert r.returncode == 1 and r.stderr.splitlines() == [f"ckpt: error: {tmp_path / 'nope'}: no such directory"]
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / ".metadata").write_bytes(b"not a pickle")
    r = run_ckpt("validate", str(damaged))
    assert r.returncode == 1 and "FAILED" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.slow
def test_exit_1_diff_differs():
    r = run_ckpt("diff", ORBAX, DCP)
    assert r.returncode == 1 and r.stdout.rstrip().splitlines()[-1].startswith("different: ")


# -- exit code 2: every usage error, in click's one style ----------------------------

USAGE_ERRORS = [
    # (args, the Error: line) -- values the core parses, each once printed in another style with exit 1
    (["reshard", ORBAX, "{dst}", "--mesh", "data:2"],
     "--mesh wants NAME=SIZE[,NAME=SIZE...], e.g. data=2,model=4; got 'data:2'"),
    (["reshard", ORBAX, "{dst}", "--mesh", "data=2", "--devices", "4"], "--mesh data=2 has 2 devices but --devices is 4"),
    (["reshard", ORBAX, "{dst}", "--mesh", "data=2", "--devices", "2", "--fsdp", "fsdp"],
     "--fsdp: axis 'fsdp' is not in the mesh (data)"),
    (["reshard", ORBAX, "{dst}", "--mesh", "data=2", "--devices", "2", "--rules", "{tmp}/missing.json"],
     "{tmp}/missing.json: cannot read the rules file: No such file or directory"),
    (["reshard", ORBAX, "{dst}", "--mesh", "data=2", "--devices", "2", "--rules", "{tmp}/bad.toml"], None),
    (["convert", ORBAX, "{dst}", "--to", "dcp", "--rename", "noequals"], "--rename needs REGEX=REPL, got 'noequals'"),
    (["diff", ORBAX, ORBAX, "--rename", "noequals"], "--rename needs REGEX=REPL, got 'noequals'"),
    (["convert", ORBAX, "{dst}", "--to", "dcp", "--dtype", "float77"], None),
    (["convert", ORBAX, "{dst}", "--to", "dcp", "--dtype", "int8"], "--dtype must be a floating type, got int8"),
    # a --step value that can never name a step (a step the root lacks is not-found, exit 1: below)
    (["inspect", ROOT_DIR, "--step", ""], "--step '': empty; give a step number, a step's name or 'latest'"),
    (["validate", FLAX_ROOT, "--step", " "], "--step ' ': empty; give a step number, a step's name or 'latest'"),
    (["inspect", ORBAX, "--step", "3"],
     f"{ORBAX}: --step 3 given, but this is a single step, not a CheckpointManager root"),
    (["convert", LLAMA, "{dst}", "--to", "safetensors", "--max-shard-size", "5XB"],
     "--max-shard-size: '5XB' is not a size (e.g. 5GB, 500MB, 2GiB, or a number of bytes)"),
    # click's own and the commands' own usage errors: the same style
    (["inspect", ORBAX, "--depth", "0"], None),
    (["convert", ORBAX, "{dst}", "--to", "dcp", "--memory", "12zz"], None),
    (["convert", ORBAX, "{dst}", "--to", "dcp", "--memory", "1KB"], "Invalid value for '--memory': must be at least 4 MiB, got '1KB'"),
    (["convert", LLAMA, "{dst}", "--to", "dcp", "--max-shard-size", "1GB"], "--max-shard-size applies to --to safetensors only"),
    (["diff", ROOT_DIR, ROOT_DIR, "--step", "1", "--step-a", "1"],
     "--step applies to both sides; give it or --step-a/--step-b, not both"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, message", USAGE_ERRORS, ids=[" ".join(a[i] for i in (0, -2, -1)) for a, _ in USAGE_ERRORS])
def test_exit_2_usage_error_in_one_style(tmp_path, args, message):
    (tmp_path / "bad.toml").write_text("rules = [[\"kernel$\", [1]]]\n")
    dst = tmp_path / "out"
    args = [a.replace("{dst}", str(dst)).replace("{tmp}", str(tmp_path)) for a in args]
    r = run_ckpt(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    if message is None:  # the message is click's or long: the style is the same
        assert lines[:3] == _usage_lines(args[0], "")[:3] and lines[3].startswith("Error: ") and len(lines) == 4, lines
    else:
        assert lines == _usage_lines(args[0], message.replace("{tmp}", str(tmp_path))), lines
    assert r.stdout == "" and not dst.exists()


# a step the run root does not have: not-found, exit 1, one line naming the root and its steps,
# the same on every root and command (was a usage error on Orbax and Flax roots)
STEP_NOT_FOUND = [
    (["inspect", ROOT_DIR, "--step", "abc"], ROOT_DIR, "steps: 1, 2 committed; 3 in-progress"),
    (["validate", ROOT_DIR, "--step", "abc"], ROOT_DIR, "steps: 1, 2 committed; 3 in-progress"),
    (["validate", FLAX_ROOT, "--step", "abc"], FLAX_ROOT, "steps: 1, 2 committed"),
    (["diff", ROOT_DIR, ROOT_DIR, "--step", "abc"], ROOT_DIR, "steps: 1, 2 committed; 3 in-progress"),
    (["convert", ROOT_DIR, "{dst}", "--to", "dcp", "--step", "abc"], ROOT_DIR, "steps: 1, 2 committed; 3 in-progress"),
    (["inspect", ROOT_DIR, "--step", "7", "--json"], ROOT_DIR, "steps: 1, 2 committed; 3 in-progress"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, root, steps", STEP_NOT_FOUND, ids=[" ".join(a[:1] + a[-2:]) for a, _, _ in STEP_NOT_FOUND])
def test_exit_1_a_step_the_root_does_not_have(tmp_path, args, root, steps):
    dst = tmp_path / "out"
    args = [a.replace("{dst}", str(dst)) for a in args]
    r = run_ckpt(*args)
    asked = args[args.index("--step") + 1]
    line = f"ckpt: error: {root}: --step {asked}: no such step ({steps})"
    assert (r.returncode, r.stderr) == (1, line + "\n") and not dst.exists()
    if "--json" in args:
        assert json.loads(r.stdout) == {"ok": False, "error": {"code": "not-found", "message": line[len("ckpt: error: "):],
                                                                "path": root}}
    else:
        assert r.stdout == ""


@pytest.mark.slow
def test_unknown_dtype_names_the_floating_types():
    r = run_ckpt("convert", ORBAX, "/nonexistent/out", "--to", "dcp", "--dtype", "float77")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1].startswith("Error: --dtype: unknown dtype 'float77' (floating types: float16, bfloat16,")


# -- exit code 130: interrupted --------------------------------------------------------


def test_exit_130_interrupted_and_json_says_so():
    code = (
        "import ckpt_tool.cli.inspect_cmd as m\n"
        "def interrupted(*a, **k):\n"
        "    raise KeyboardInterrupt\n"
        "m.inspect_checkpoint = interrupted\n"
        "from ckpt_tool.cli.main import main\n"
        f"main(['inspect', {ORBAX!r}, '--json'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 130 and r.stderr.strip().splitlines() == ["ckpt: interrupted"], (r.returncode, r.stderr)
    assert json.loads(r.stdout) == {"ok": False, "error": {"code": "interrupted", "message": "interrupted", "path": None}}


# -- --json: a hard error is JSON on stdout too ---------------------------------------------


def _json_error(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode in (1, 2), (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) in (1, 4), r.stderr  # the one line (or click's usage block)
    doc = json.loads(r.stdout)
    assert set(doc) == {"ok", "error"} and doc["ok"] is False
    assert set(doc["error"]) == {"code", "message", "path"}
    assert doc["error"]["message"] in r.stderr
    return doc["error"]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "validate", "diff", "convert", "reshard"])
def test_json_error_not_a_checkpoint(tmp_path, command):
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "notes.txt").write_text("my notes")
    args = {
        "inspect": ["inspect", str(nothing)],
        "validate": ["validate", str(nothing)],
        "diff": ["diff", str(nothing), ORBAX],
        "convert": ["convert", str(nothing), str(tmp_path / "out"), "--to", "dcp"],
        "reshard": ["reshard", str(nothing), str(tmp_path / "out"), "--mesh", "data=1", "--devices", "1"],
    }[command]
    error = _json_error(run_ckpt(*args, "--json"))
    assert error["code"] == "unknown-format" and error["path"] == str(nothing), error


@pytest.mark.slow
@pytest.mark.parametrize("command", ["convert", "reshard"])
def test_json_error_destination_exists(tmp_path, command):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("my notes")
    extra = ["--to", "dcp"] if command == "convert" else ["--mesh", "data=1", "--devices", "1"]
    error = _json_error(run_ckpt(command, ORBAX, str(dst), *extra, "--json"))
    assert error["code"] == "destination-exists" and error["path"] == str(dst) and "exists" in error["message"], error
    assert (dst / "notes.txt").read_text() == "my notes"


@pytest.mark.slow
def test_json_error_missing_path_and_usage(tmp_path):
    error = _json_error(run_ckpt("inspect", str(tmp_path / "nope"), "--json"))
    assert error == {"code": "not-found", "message": f"{tmp_path / 'nope'}: no such directory", "path": str(tmp_path / "nope")}
    r = run_ckpt("reshard", ORBAX, str(tmp_path / "out"), "--mesh", "data:2", "--json")
    assert r.returncode == 2 and _json_error(r)["code"] == "usage"
    r = run_ckpt("inspect", ORBAX, "--depth", "x", "--json")  # click's own, before the command runs
    assert r.returncode == 2 and _json_error(r) == {
        "code": "usage", "message": "Invalid value for '--depth': 'x' is not a valid integer range.", "path": None}


@pytest.mark.slow
def test_json_error_only_when_json_is_the_flag(tmp_path):
    # here --json is the value of --filter, not the flag: stdout stays empty
    r = run_ckpt("inspect", "--filter", "--json", str(tmp_path / "nope"))
    assert r.returncode == 1 and r.stdout == ""
    r = run_ckpt("inspect", str(tmp_path / "nope"))
    assert r.returncode == 1 and r.stdout == ""


# -- help texts and command names ---------------------------------------------------------


def test_mistyped_command_suggests_the_right_one():
    r = run_ckpt("insepct", ORBAX)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == "Error: No such command 'insepct'. Did you mean 'inspect'?"
    r = run_ckpt("zzzz")
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == "Error: No such command 'zzzz'."


def test_top_help_lists_every_format_and_whole_summaries():
    r = run_ckpt("--help")
    assert r.returncode == 0
    for fmt in ("Orbax", "DCP", "safetensors", "Flax", "T5X"):
        assert fmt in r.stdout, fmt
    commands = r.stdout.split("Commands:\n", 1)[1].splitlines()
    names = [line.split()[0] for line in commands if line.startswith("  ") and not line.startswith("   ")]
    assert names == ["inspect", "validate", "diff", "ls", "latest", "convert", "reshard", "manifest"]
    assert len(commands) == len(names), commands  # one line each: no summary wraps
    for line in commands:
        assert not line.rstrip().endswith("..."), line  # not cut mid-sentence
        assert line.rstrip().endswith("."), line


def test_top_help_is_made_from_the_registry_when_shown(monkeypatch):
    """Not frozen when the CLI is imported: a format registered for a while (the conformance tests'
    throwaway one), with the CLI imported meanwhile, is not named in a help shown afterwards."""
    import dataclasses

    from ckpt_tool import formats
    from ckpt_tool.cli.app import render_top_help

    before = render_top_help()
    toy = dataclasses.replace(formats.REGISTRY["safetensors"], name="toyhelp", title="Toyhelp files",
                              short="Toyhelp", reads="Toyhelp files", listed=len(formats.REGISTRY))
    with monkeypatch.context() as m:
        m.setattr(formats, "REGISTRY", {**formats.REGISTRY, "toyhelp": toy})
        assert "Toyhelp files" in render_top_help()
    assert render_top_help() == before and "Toyhelp" not in before


def test_reshard_help_is_true_and_explains_rules():
    r = run_ckpt("reshard", "--help")
    text = " ".join(r.stdout.split())
    assert "(Orbax or DCP)" not in text
    assert "safetensors" in text and "Flax" in text and "T5X" in text
    assert "TOML: rules = [[" in text and "docs/commands/reshard.md" in text


@pytest.mark.slow
def test_reshard_reads_what_its_help_says(tmp_path):
    for src in (LLAMA, str(fixture_path("flax_msgpack")), str(fixture_path("t5x"))):
        r = run_ckpt("reshard", src, str(tmp_path / os.path.basename(src)), "--mesh", "data=1", "--devices", "1")
        assert r.returncode == 0, r.stderr


def test_top_help_imports_neither_numpy_nor_tensorstore():
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tool", "--help"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "Commands:" in r.stdout
    modules = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "ckpt_tool.cli.main" in modules  # the trace is there
    heavy = [m for m in modules if m.split(".")[0] in ("numpy", "tensorstore", "rich", "ml_dtypes")]
    assert not heavy, heavy


# -- plurals, units, plain output ---------------------------------------------------------------


@pytest.mark.slow
def test_plurals_agree_with_their_counts():
    r = run_ckpt("validate", str(fixture_path("t5x")))
    assert "checked 1 step," in r.stdout and "1 steps" not in r.stdout
    r = run_ckpt("validate", DCP)
    assert "1 file)" in r.stdout and "0 errors, 0 warnings" in r.stdout
    r = run_ckpt("inspect", DCP)
    assert re.search(r"int64\s+1 array, ", r.stdout) and "1 arrays" not in r.stdout
    r = run_ckpt("validate", DCP, "--format", "github")
    assert r.stdout.splitlines()[-1] == "ckpt validate dcp_single: 0 errors, 0 warnings".replace("dcp_single", DCP)


@pytest.mark.slow
def test_plural_reshard_summary(tmp_path):
    r = run_ckpt("reshard", str(fixture_path("t5x")), str(tmp_path / "out"), "--mesh", "data=1", "--devices", "1")
    assert r.returncode == 0 and "(1 device)" in r.stdout and "1 devices" not in r.stdout


def test_not_an_int_value_message(tmp_path):
    from ckpt_tool.base.errors import a_type

    assert (a_type(7), a_type("x"), a_type(object())) == ("an int", "a str", "an object")


def test_progress_bar_in_binary_units():
    from rich.console import Console
    from rich.progress import Progress

    from ckpt_tool.cli.progress import _columns

    console = Console(force_terminal=False, width=120, record=True)
    progress = Progress(*_columns(), console=console, auto_refresh=False)
    task = progress.add_task("converting", total=3 * 2**30)
    progress.update(task, completed=2**30)
    console.print(progress.get_renderable())
    text = console.export_text()
    assert "1.0 GiB / 3.0 GiB" in text and " GB" not in text


@pytest.mark.slow
def test_demo_output_plain_when_piped(tmp_path):
    # the demo script's own headers, with `echo` standing in for ckpt
    r = subprocess.run(["bash", str(ROOT / "fixtures" / "demo.sh"), "echo"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "$ echo inspect orbax_ocdbt_zarr2" in r.stdout
    assert "\x1b" not in r.stdout
    # and what ckpt prints into a pipe: trees, headers, verdicts, with NO_COLOR or without
    for env in (None, {"NO_COLOR": "1"}):
        for args in (["inspect", ORBAX, "--depth", "2"], ["validate", DCP], ["diff", ORBAX, ORBAX]):
            out = run_ckpt(*args, env=env)
            assert out.returncode == 0 and "\x1b" not in out.stdout + out.stderr, args


def test_cli_start_bench_row():
    """bench/cli_start_bench.py's row in run_all's table (no bench is run here)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import cli_start_bench

    def res(name, best, rss):
        return {"name": name, "command": f"ckpt --{name}", "ok": True, "error": None, "runs_s": [best],
                "best_s": best, "peak_rss_kib": rss, "check_errors": []}

    doc = {"bench": "cli_start", "runs": 10, "results": [res("version", 0.11, 14000), res("help", 0.12, 15000)],
           "ratio": 1.09, "target": 1.5, "met": True, "help_heavy_imports": [], "help_modules": 112, "ok": True}
    [row] = cli_start_bench.summary_rows(doc)
    assert row["case"] == "ckpt --help" and row["baseline"] == "ckpt --version"
    assert (row["ckpt_s"], row["baseline_s"], row["ratio"], row["met"]) == (0.12, 0.11, 1.09, True)
    assert row["target"] == "ckpt/baseline <= 1.5x" and row["rss_mib"] == 15 and not row["error"]
    doc["help_heavy_imports"] = ["numpy"]
    assert "numpy" in cli_start_bench.summary_rows(doc)[0]["case"]
    assert cli_start_bench.check("help", "Usage: ckpt\n  inspect x") != []


def test_readme_install_section_and_exit_code_table():
    readme = (ROOT / "README.md").read_text()
    assert "\n## Install\n" in readme and "pip install ." in readme and "pipx install ." in readme
    table = (ROOT / "docs" / "exit-codes.md").read_text().split("\n## ", 1)[0]
    codes = [line.split("|")[1].strip() for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert codes == ["0", "1", "2", "130"]  # one row each, each with its test above
