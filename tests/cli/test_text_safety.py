"""Names and text from the input, shown and parsed safely (issue 29).

Real files: state dicts written by torch.save whose keys hold control
characters or a lone surrogate (pickle stores it surrogatepass), committed
fixtures copied with their tracker file rewritten, a fixture copied under a
directory name holding a terminal escape. Every command runs as a whole
process with a strict UTF-8 stdout (what a UTF-8 terminal gives): no line may
hold a raw control character, nothing may end in `internal error`, --json must
round-trip, and convert must write a name its target library reads back
identically or refuse it in one line naming the tensor.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, fixture_path

torch = pytest.importorskip("torch")

# what a terminal acts on or a line reader breaks at: C0 but the line ends, DEL, C1, the Unicode
# line separators, bidi controls (a lone surrogate cannot even be decoded: see _run)
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

CONTROL_KEYS = ["evil\x1b[31mred\x1b[0m", "line\nforged OK", "cr\rback", "c1\x9bz", "tab\tbed", "rtl\u202eevil"]
SURROGATE_KEY = "\udc80abc"


def _run(*args: str | Path) -> subprocess.CompletedProcess:
    """`ckpt ARGS` as a whole process whose stdout is strict UTF-8 (a UTF-8 locale's), its output
    decoded strictly: a raw lone surrogate or a stray byte fails here as it would on a terminal."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
    env.pop("CKPT_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", *map(str, args)], capture_output=True, env=env,
                       cwd=ROOT, timeout=180)
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8"))


def _clean(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`r`, checked: no internal error, no traceback, no raw control character in any line."""
    for stream in (r.stdout, r.stderr):
        assert "internal error" not in stream and "Traceback" not in stream, stream
        for line in stream.splitlines():
            assert not RAW.search(line), repr(line)
    return r


@pytest.fixture(scope="module")
def named(tmp_path_factory) -> Path:
    """A torch.save state dict whose keys hold control characters, and an ordinary one."""
    path = tmp_path_factory.mktemp("names") / "controls.pt"
    torch.save({**{k: torch.full((i + 1,), float(i)) for i, k in enumerate(CONTROL_KEYS)}, "plain": torch.ones(2)}, path)
    return path


@pytest.fixture(scope="module")
def surrogate(tmp_path_factory) -> Path:
    """A torch.save state dict with a lone-surrogate key (and a string value holding one)."""
    path = tmp_path_factory.mktemp("surrogate") / "surrogate.pt"
    torch.save({SURROGATE_KEY: torch.arange(3, dtype=torch.float32), "ok": torch.zeros(2)}, path)
    assert list(torch.load(path)) == [SURROGATE_KEY, "ok"]  # torch gives the name back as it is
    return path


# -- names holding control characters ------------------------------------------------------


@pytest.mark.parametrize("args", [(), ("--flat",)], ids=["tree", "flat"])
def test_inspect_escapes_names(named, args):
    r = _clean(_run("inspect", named, *args))
    assert r.returncode == 0
    shown = r.stdout
    for escaped in ("evil\\x1b[31mred\\x1b[0m", "line\\nforged OK", "cr\\rback", "c1\\x9bz", "tab\\tbed", "rtl\\u202eevil"):
        assert escaped in shown, shown
    # the newline did not forge a line of its own
    assert not any(line.lstrip().startswith("forged OK") for line in shown.splitlines())


def test_inspect_json_keeps_names_exact(named):
    r = _clean(_run("inspect", named, "--json"))
    assert r.returncode == 0
    names = sorted(leaf["name"] for leaf in json.loads(r.stdout)["leaves"])
    assert names == sorted([*CONTROL_KEYS, "plain"]) == sorted(torch.load(named))


@pytest.mark.slow
def test_validate_diff_and_convert_lines_escape_names(named, tmp_path):
    r = _clean(_run("validate", named))
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("OK")
    other = tmp_path / "other.pt"
    torch.save({"plain": torch.ones(2)}, other)
    r = _clean(_run("diff", named, other))
    assert r.returncode == 1
    assert "only_a   line\\nforged OK: only in A" in r.stdout.splitlines()
    r = _clean(_run("convert", named, tmp_path / "out", "--to", "safetensors"))
    assert r.returncode == 0 and "converted" in r.stdout
    # the names are written as they are: safetensors gives back the same ones
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        assert sorted(f.keys()) == sorted(torch.load(named))


@pytest.mark.slow
def test_paths_and_step_names_are_escaped(tmp_path):
    """A run root under a directory name holding ESC and a newline, and a step directory named with
    ESC (Orbax takes `<prefix>_N`): ls, latest, validate (human and github), inspect show escapes."""
    parent = tmp_path / "runs\x1b[2J\nforged"
    root = parent / "manager"
    shutil.copytree(fixture_path("orbax_manager"), root)
    (root / "2").rename(root / "x\x1b[31m_2")
    r = _clean(_run("ls", root))
    assert r.returncode == 0 and "x\\x1b[31m_2" in r.stdout
    assert r.stdout.splitlines()[0].startswith(str(tmp_path) + "/runs\\x1b[2J\\nforged/manager  (")
    r = _clean(_run("latest", root))
    assert r.returncode == 0 and r.stdout == str(tmp_path) + "/runs\\x1b[2J\\nforged/manager/x\\x1b[31m_2\n"
    r = _clean(_run("ls", root, "--json"))
    assert "x\x1b[31m_2" in [s["name"] for s in json.loads(r.stdout)["steps"]]
    for args in ((), ("--format", "github")):  # (the fixture's interrupted save: a warning to report)
        r = _clean(_run("validate", root, *args))
        assert r.returncode == 0 and "uncommitted-save" in r.stdout and "\\x1b[2J\\nforged" in r.stdout
    r = _clean(_run("inspect", root, "--step", "2"))
    assert r.returncode == 0 and r.stdout.startswith(str(tmp_path) + "/runs\\x1b[2J\\nforged/manager")


# -- a lone surrogate ---------------------------------------------------------------------


@pytest.mark.slow
def test_surrogate_name_is_shown_escaped(surrogate):
    r = _clean(_run("inspect", surrogate))
    assert r.returncode == 0 and "  \\udc80abc  float32[3]  12 B" in r.stdout.splitlines()
    r = _clean(_run("inspect", surrogate, "--flat"))
    assert r.returncode == 0 and any(line.startswith("\\udc80abc  float32[3]") for line in r.stdout.splitlines())
    r = _clean(_run("validate", surrogate))
    assert r.returncode == 0


def test_surrogate_name_round_trips_in_json(surrogate):
    r = _clean(_run("inspect", surrogate, "--json"))
    assert r.returncode == 0 and "\\udc80abc" in r.stdout and r.stdout.isascii()
    assert [leaf["name"] for leaf in json.loads(r.stdout)["leaves"]] == list(torch.load(surrogate))


@pytest.mark.slow
def test_surrogate_name_converts_to_dcp_as_it_is(surrogate, tmp_path):
    """DCP pickles its names: torch's own load gives back the lone-surrogate key and its data."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    r = _clean(_run("convert", surrogate, out, "--to", "dcp"))
    assert r.returncode == 0
    state = {SURROGATE_KEY: torch.empty(3), "ok": torch.empty(2)}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    expected = torch.load(surrogate)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["safetensors", "orbax"])
def test_surrogate_name_is_refused_where_utf8_cannot_hold_it(surrogate, tmp_path, to):
    """safetensors' header and Orbax's metadata and paths are UTF-8: the libraries fail on the name
    themselves (save_file: UnicodeEncodeError; safe_open of the JSON escape: 'lone leading surrogate
    in hex escape'; orbax's save: a pybind11 cast error). One line naming the tensor, nothing written;
    --skip-unsupported leaves it out."""
    out = tmp_path / to
    r = _clean(_run("convert", surrogate, out, "--to", to))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"ckpt: error: \\udc80abc: its name '\\udc80abc' holds a lone surrogate (not Unicode text), which "
        f"{'safetensors' if to == 'safetensors' else 'Orbax'} checkpoints cannot store; use --skip-unsupported "
        "to leave it out"]
    assert not out.exists()
    r = _clean(_run("convert", surrogate, out, "--to", to, "--skip-unsupported"))
    assert r.returncode == 0 and r.stdout.startswith("skipped \\udc80abc: its name")
    if to == "safetensors":
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "np") as f:
            assert list(f.keys()) == ["ok"]
    else:
        import orbax.checkpoint as ocp

        assert list(ocp.PyTreeCheckpointer().restore(str(out))) == ["ok"]


@pytest.mark.slow
def test_surrogate_string_value_refused_by_orbax_kept_by_dcp(tmp_path):
    src = tmp_path / "values.pt"
    torch.save({"w": torch.ones(2), "s": "bad\udc80text"}, src)
    r = _clean(_run("inspect", src, "--values"))
    assert r.returncode == 0 and "s  string = 'bad\\udc80text'" in r.stdout.splitlines()[-2:][0]
    r = _clean(_run("convert", src, tmp_path / "orbax", "--to", "orbax"))
    assert r.returncode == 1 and r.stderr.startswith("ckpt: error: s: its string 'bad\\udc80text' holds a lone surrogate")
    import torch.distributed.checkpoint as dcp

    r = _clean(_run("convert", src, tmp_path / "dcp", "--to", "dcp"))
    assert r.returncode == 0
    state = {"w": torch.empty(2), "s": ""}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert state["s"] == "bad\udc80text"


# -- step numbers from text: ASCII digits only ----------------------------------------------

UNICODE_DIGITS = ["\u00b2", "\u0663", "\uff11"]  # '²' (isdigit, int() refuses), '٣', fullwidth '１'


@pytest.fixture
def megatron_root(tmp_path):
    root = tmp_path / "megatron_run"
    shutil.copytree(fixture_path("megatron_run"), root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("digits", UNICODE_DIGITS)
def test_megatron_tracker_of_unicode_digits_is_a_bad_tracker(megatron_root, digits):
    tracker = megatron_root / "latest_checkpointed_iteration.txt"
    tracker.write_text(digits)
    says = f"{digits!r} is not an iteration number (or 'release')"
    r = _clean(_run("inspect", megatron_root))
    assert r.returncode == 1 and r.stderr == f"ckpt: error: {tracker}: {says}\n"
    r = _clean(_run("validate", megatron_root))
    assert r.returncode == 1 and f"error bad-metadata: {says}  latest_checkpointed_iteration.txt" in r.stdout
    r = _clean(_run("ls", megatron_root))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == f"latest_checkpointed_iteration.txt: {says}"
    r = _clean(_run("latest", megatron_root))
    assert r.returncode == 0 and r.stdout == f"{megatron_root}/iter_0000020\n"
    assert f"ckpt: latest: latest_checkpointed_iteration.txt: {says}" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("digits", UNICODE_DIGITS)
def test_verl_tracker_of_unicode_digits_is_a_bad_tracker(tmp_path, digits):
    root = tmp_path / "runs_verl"
    shutil.copytree(fixture_path("runs_verl"), root)
    (root / "latest_checkpointed_iteration.txt").write_text(digits)
    says = f"{digits!r} is not a step number"
    r = _clean(_run("ls", root))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == f"latest_checkpointed_iteration.txt: {says}"
    r = _clean(_run("latest", root))
    assert r.returncode == 0 and r.stdout == f"{root}/global_step_4\n"
    r = _clean(_run("ls", root, "--json"))
    assert json.loads(r.stdout)["pointer"]["problem"] == says


@pytest.mark.parametrize("args, code", [
    (("inspect", fixture_path("megatron_run"), "--step", "\u00b2"), 2),
    (("inspect", fixture_path("runs_hf_trainer"), "--step", "\u00b2"), 2),
    (("diff", fixture_path("runs_torchtitan"), "--step-a", "\u00b2", "--step-b", "10"), 2),
    (("reshard", fixture_path("orbax_ocdbt_zarr2"), "/nonexistent/out", "--mesh", "data=\u00b2", "--devices", "1",
      "--dry-run"), 2),
], ids=["megatron-step", "hf-step", "diff-step", "mesh-size"])
def test_options_of_unicode_digits_are_usage_errors(args, code):
    r = _clean(_run(*args))
    assert r.returncode == code, r.stderr
    assert "\u00b2" in r.stderr


@pytest.mark.slow
def test_file_name_not_utf8_with_escape_in_manifest_and_findings(tmp_path):
    """A file name that is not UTF-8 and holds ESC (Python lists it as 'extra\\udc80\\x1b[31m'):
    the manifest records it (JSON escapes), and verify and validate's findings show it escaped."""
    ck = tmp_path / "dcp"
    shutil.copytree(fixture_path("dcp_single"), ck)
    odd = os.path.join(os.fsencode(ck), b"extra\x80\x1b[31m")
    Path(odd.decode("utf-8", "surrogateescape")).write_bytes(b"not a tensor")
    r = _clean(_run("manifest", "write", ck))
    assert r.returncode == 0
    assert "extra\udc80\x1b[31m" in json.loads((ck / "integrity.json").read_text())["files"]
    os.remove(odd)
    for args in (("manifest", "verify", ck), ("validate", ck), ("validate", ck, "--format", "github")):
        r = _clean(_run(*args))
        assert r.returncode == 1 and "extra\\udc80\\x1b[31m" in r.stdout, r.stdout
