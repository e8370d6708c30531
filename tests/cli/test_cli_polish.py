"""Issue 30, item 7: the command line's small print.

- every count phrase agrees with its count ("1 param", "1 leaf ... matches", never "1 params");
- an exact count is shown in parentheses only where the short form differs ("54.77K (54,772)", "975");
- every command's --json carries "ok", true exactly when the command exits 0;
- every command's --help renders whole at 80 columns (no line past it, no summary cut with "...");
- help texts name every format the registry says a command reads or writes (made from the registry);
- the public API's docstrings name no stale subset of the formats.

Commands run as whole processes (`python -m ckpt_tool`), as a user runs them; fixtures are written by
the real libraries (fixtures/generate.py and friends).
"""
from __future__ import annotations

import json
import re

import pytest

from conftest import fixture_path, run_ckpt

ORBAX = str(fixture_path("orbax_ocdbt_zarr2"))
RUN_ROOT = str(fixture_path("runs_orbax"))  # its newest step holds one int64 scalar array
LLAMA_DS = str(fixture_path("deepspeed_z3_hf_llama"))  # 54,772 parameters
T5X = str(fixture_path("t5x"))

# "1 <plural>" in text output: what no count phrase may say
_ONE_PLURAL = re.compile(
    r"(?<![\d.,])1 (params|parameters|leaves|arrays|values|files|steps|chunks|errors|warnings|devices|"
    r"differences|tensors|source chunks|host arrays|common leaves)\b"
)


def _json(*args: str) -> tuple[int, dict]:
    r = run_ckpt(*args, "--json")
    return r.returncode, json.loads(r.stdout)


# -- count phrases --------------------------------------------------------------------------


@pytest.mark.slow
def test_one_param_is_singular_in_the_dtype_rows():
    code, doc = _json("inspect", RUN_ROOT)
    assert code == 0
    ones = [d for d, t in doc["summary"]["by_dtype"].items() if t["parameters"] == 1]
    assert ones == ["int64"]  # the step counter: what the text rows must say in the singular
    r = run_ckpt("inspect", RUN_ROOT)
    assert r.returncode == 0
    assert re.search(r"^\s+int64\s+1 array, 1 param, 8 B$", r.stdout, re.M), r.stdout
    assert not _ONE_PLURAL.search(r.stdout), _ONE_PLURAL.search(r.stdout)


@pytest.mark.slow
def test_diff_of_one_leaf_agrees_in_number():
    code, doc = _json("inspect", ORBAX)
    leaf = next(l for l in doc["leaves"] if l["kind"] == "array")
    pattern = "/".join(str(k) for k in leaf["keys"])
    r = run_ckpt("diff", ORBAX, ORBAX, "--filter", pattern)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "same: 1 leaf (structure, shapes, dtypes) matches"
    r = run_ckpt("diff", ORBAX, ORBAX, "--filter", pattern, "--values")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "same: 1 leaf and its values match"
    # many leaves: the plural, as before
    r = run_ckpt("diff", ORBAX, ORBAX)
    assert r.stdout.strip() == f"same: {len(doc['leaves'])} leaves (structure, shapes, dtypes) match"


@pytest.mark.slow
def test_no_one_plural_in_the_text_of_any_command(tmp_path):
    outputs = [
        run_ckpt("inspect", RUN_ROOT), run_ckpt("inspect", T5X), run_ckpt("validate", T5X),
        run_ckpt("ls", RUN_ROOT), run_ckpt("validate", RUN_ROOT, "--step", "all"),
        run_ckpt("reshard", T5X, str(tmp_path / "r"), "--mesh", "data=1", "--devices", "1", "--dry-run"),
        run_ckpt("reshard", T5X, str(tmp_path / "r"), "--mesh", "data=1", "--devices", "1"),
        run_ckpt("convert", T5X, str(tmp_path / "c"), "--to", "safetensors", "--select",
                 "target/encoder/token_embedder/**"),  # 1 array, 1 chunk
    ]
    for r in outputs:
        assert r.returncode == 0, (r.args, r.stderr)
        assert not _ONE_PLURAL.search(r.stdout), (r.args, _ONE_PLURAL.search(r.stdout), r.stdout)


# -- exact counts ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_parameters_show_the_exact_count_only_when_the_short_form_differs():
    code, doc = _json("inspect", ORBAX)
    n = doc["summary"]["parameters"]
    assert n < 1000
    r = run_ckpt("inspect", ORBAX)
    assert re.search(rf"^\s+parameters\s+{n}$", r.stdout, re.M), r.stdout  # not "975 (975)"
    code, doc = _json("inspect", LLAMA_DS)
    n = doc["summary"]["parameters"]
    assert n >= 1000
    r = run_ckpt("inspect", LLAMA_DS)
    assert re.search(rf"^\s+parameters\s+{n / 1000:.2f}K \({n:,}\)$", r.stdout, re.M), r.stdout


# -- --json: "ok" as the exit status says ---------------------------------------------------------


@pytest.mark.slow
def test_every_commands_json_says_ok_on_success(tmp_path):
    runs = {
        "inspect": ("inspect", ORBAX),
        "validate": ("validate", ORBAX),
        "diff": ("diff", ORBAX, ORBAX),
        "ls": ("ls", RUN_ROOT),
        "latest": ("latest", RUN_ROOT),
        "convert": ("convert", T5X, str(tmp_path / "c"), "--to", "orbax"),
        "reshard --dry-run": ("reshard", T5X, str(tmp_path / "p"), "--mesh", "data=1", "--devices", "1", "--dry-run"),
        "reshard": ("reshard", T5X, str(tmp_path / "r"), "--mesh", "data=1", "--devices", "1"),
        "manifest write": ("manifest", "write", str(tmp_path / "c")),
        "manifest verify": ("manifest", "verify", str(tmp_path / "c")),
    }
    for what, args in runs.items():
        code, doc = _json(*args)
        assert code == 0, what
        assert doc.get("ok") is True, (what, sorted(doc))


@pytest.mark.slow
def test_json_ok_is_false_where_the_exit_status_is_1(tmp_path):
    code, doc = _json("diff", ORBAX, T5X)
    assert code == 1 and doc["ok"] is False and doc["same"] is False
    code, doc = _json("inspect", str(tmp_path / "nothing"))
    assert code == 1 and doc["ok"] is False and doc["error"]["code"] == "not-found"


# -- help texts -------------------------------------------------------------------------------------


def _helps() -> dict[str, str]:
    from ckpt_tool.cli.main import COMMANDS

    names = ["", *COMMANDS, "manifest write", "manifest verify"]
    helps = {}
    for name in names:
        r = run_ckpt(*name.split(), "--help", env={"COLUMNS": "80"})
        assert r.returncode == 0, (name, r.stderr)
        helps[name or "ckpt"] = r.stdout
    return helps


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    return _helps()


def _squeezed(text: str) -> str:
    """The text without whitespace: a name that click wrapped across lines (at a space or a hyphen) is found."""
    return "".join(text.split())


@pytest.mark.slow
def test_every_help_renders_whole_at_80_columns(helps):
    for name, text in helps.items():
        for line in text.splitlines():
            assert len(line) <= 80, (name, line)
            if not line.startswith("Usage:"):  # ("[ARGS]..." is click's usage line)
                assert not line.rstrip().endswith("..."), (name, line)  # a summary click cut short
        if "Commands:" in text:  # a group's list of commands: one whole sentence each
            for line in text.split("Commands:\n", 1)[1].splitlines():
                assert line.rstrip().endswith("."), (name, line)


@pytest.mark.slow
def test_every_help_names_every_format_it_reads_or_writes(helps):
    from ckpt_tool import formats
    from ckpt_tool.formats.roots import LAYOUTS

    reads = [f.label for f in formats.shown()]
    writes = formats.writable_labels()
    assert len(reads) == 8 and len(writes) == 4  # what the registry says today
    expected = {
        "inspect": reads, "validate": reads, "diff": reads, "manifest": reads,
        "convert": reads + writes, "reshard": reads + [formats.reshard_format().label],
        "ls": [layout.title for layout in LAYOUTS], "latest": [layout.title for layout in LAYOUTS],
        "ckpt": [f.reads or f.title for f in formats.shown()] + writes,
    }
    for name, names in expected.items():
        text = _squeezed(helps[name])
        missing = [n for n in names if _squeezed(n) not in text]
        assert not missing, (name, missing)


# -- docstrings ---------------------------------------------------------------------------------------


def test_open_docstring_names_no_stale_subset_of_the_formats():
    import ckpt_tool
    from ckpt_tool import formats

    doc = ckpt_tool.open.__doc__ or ""
    named = [f.name for f in formats.shown() if f.label in doc or f.title in doc]
    # a list of formats goes stale: the docstring names them all, or points at the registry
    assert named == [] or len(named) == len(formats.shown()), named
    assert "formats.shown()" in doc or len(named) == len(formats.shown())
