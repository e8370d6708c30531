"""Start-up (issue 23 item 4): `ckpt inspect` imports what the command at hand needs and nothing
else. Detection asks every format in turn whether a directory is its own; the formats asked
before the one that says yes answer from a light detection module or the registry's claims, so
inspect of an Orbax or DCP checkpoint does not load the Megatron, msgpack, DeepSpeed,
safetensors or torch.save readers (nor, for DCP, the Orbax reader). The cheap answers must be
the readers' own: detection with them equals detection by every reader's full detect()."""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES, ROOT, fixture_path, modules_loaded_after

from ckpt_tool import formats
from ckpt_tool.base.errors import CkptError, UnknownFormatError
from ckpt_tool.storage import Storage

# packages whose reader an Orbax or DCP inspect must not import (their light detection modules and
# package __init__ it may: the registry asks them): every format's package but those two
OTHER_FORMATS = tuple(sorted({f.package.split(".")[2] for f in formats.registered()} - {"orbax", "dcp"}))
LIGHT = ("detection",)


def _loaded_after_inspect(path: str, *extra: str) -> list[str]:
    """The modules a process has loaded after `ckpt inspect PATH --json` (the CLI's own path)."""
    return modules_loaded_after(["inspect", path, "--json", *extra])


def _readers_of_other_formats(loaded: list[str]) -> list[str]:
    bad = []
    for name in loaded:
        parts = name.split(".")
        if parts[:2] == ["ckpt_tool", "formats"] and len(parts) > 3 and parts[2] in OTHER_FORMATS \
                and parts[3] not in LIGHT:
            bad.append(name)
    return bad


@pytest.mark.parametrize("name", ["orbax_ocdbt_zarr2", "orbax_plain_zarr2"])
def test_orbax_inspect_loads_no_other_format_reader(name):
    loaded = _loaded_after_inspect(str(fixture_path(name)))
    assert "ckpt_tool.formats.orbax.reader" in loaded  # (the check below sees a real inspect)
    assert not _readers_of_other_formats(loaded), _readers_of_other_formats(loaded)
    # the torch.save pickle machinery is DCP's, Megatron's, DeepSpeed's and torch.save's
    bad = [m for m in loaded if m.startswith(("ckpt_tool.machinery.torch_save", "ckpt_tool.formats.dcp", "ckpt_tool.machinery.dcp"))
           or m.split(".")[0] in ("jax", "torch", "rich", "msgpack", "zarr")]
    assert not bad, bad
    if name == "orbax_ocdbt_zarr2":  # its OCDBT walked and its .zarray checked by ckpt itself (issue 46)
        assert not [m for m in loaded if m.split(".")[0] in ("tensorstore", "ml_dtypes", "hashlib")]


@pytest.mark.parametrize("name", ["dcp_single", "dcp_multirank"])
def test_dcp_inspect_loads_no_other_format_reader(name):
    loaded = _loaded_after_inspect(str(fixture_path(name)))
    assert "ckpt_tool.machinery.dcp.reader" in loaded  # (DCP's reader: the shared DCP machinery)
    assert not _readers_of_other_formats(loaded), _readers_of_other_formats(loaded)
    # (nor tensorstore: a local root is listed and read by the file system; nor numpy: metadata
    # only, no array read, issue 46)
    bad = [m for m in loaded if m.startswith(("ckpt_tool.formats.orbax", "ckpt_tool.machinery.arrays"))
           or m.split(".")[0] in ("jax", "torch", "rich", "msgpack", "zarr", "tensorstore", "numpy", "ml_dtypes")]
    assert not bad, bad
    # nor the decoder of torch's ZStandard extension, for a checkpoint stored without it
    assert "ckpt_tool.machinery.dcp.transforms" not in loaded


def _loaded_after(argv: list[str]) -> list[str]:
    """The modules a process has loaded after the CLI ran `argv` into a pipe (plain text, not a terminal)."""
    return modules_loaded_after(argv, to_pipe=True)


# what the inspect/validate path of a local Orbax or DCP checkpoint must not load (issue 46): the
# frameworks, and rich, which renders for a terminal only (a pipe gets plain text, --json JSON)
HEAVY_EVERYWHERE = ("jax", "torch", "rich", "flax", "orbax")


@pytest.mark.parametrize("name", ["orbax_ocdbt_zarr2", "orbax_plain_zarr2", "dcp_single", "dcp_multirank"])
@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["inspect", "--flat"], ["validate"],
                                     ["validate", "--json"]])
def test_inspect_and_validate_into_a_pipe_load_no_framework_and_no_rich(name, command):
    loaded = _loaded_after([command[0], str(fixture_path(name)), *command[1:]])
    bad = [m for m in loaded if m.split(".")[0] in HEAVY_EVERYWHERE]
    assert not bad, bad


@pytest.mark.parametrize("name", ["orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3"])
@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["validate"], ["validate", "--json"]])
def test_a_local_orbax_checkpoints_metadata_is_read_without_numpy(name, command):
    """Its OCDBT manifest and leaf node (the arrays' .zarray / zarr.json live there) decode in Python
    where numpy is not loaded (storage/ocdbt_node.py), and nothing else before the first array needs
    numpy (issue 46: its import was a third of an inspect of 3,000 leaves)."""
    loaded = _loaded_after([command[0], str(fixture_path(name)), *command[1:]])
    assert "ckpt_tool.storage.ocdbt_node" in loaded  # (its database was read)
    assert not [m for m in loaded if m.split(".")[0] in ("numpy", "ml_dtypes", "tensorstore")]


def test_plain_markup_is_richs_own_without_rich():
    """render.esc and render.plain (a pipe's text, without importing rich) say what rich.markup's
    escape and Text.from_markup(...).plain say, on text full of brackets and backslashes."""
    import itertools

    from rich.markup import escape
    from rich.text import Text

    from ckpt_tool.cli.render import esc, plain

    pieces = ["[", "]", "\\", "a", "/", "bold", "[/]", "[bold]", "[/bold]", "=x", "@", "#", " ", ":smile:"]
    for n in range(4):
        for combo in itertools.product(pieces, repeat=n):
            text = "".join(combo)
            assert esc(text) == escape(text), text
            markup = f"[bold]{esc(text)}[/bold] {esc(text)}"
            assert plain(markup) == Text.from_markup(markup, emoji=False).plain, markup
            try:
                want = Text.from_markup(text, emoji=False).plain
            except Exception:  # noqa: BLE001 - markup rich refuses (a closing tag that closes nothing)
                continue
            assert plain(text) == want, text


_BIG_DCP = """
import sys, warnings
import torch, torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
dcp.save({"layers": {str(i): {"w": torch.zeros(4, 4), "b": torch.zeros(4, dtype=torch.bfloat16)} for i in range(600)}},
         checkpoint_id=sys.argv[1])
"""


def test_a_dcp_of_many_tensors_inspects_without_numpy(tmp_path):
    """A .metadata of over 128 KiB takes the pickle check's fast path (its memory bound counted by
    bytes.translate and bytes.count, not numpy's bincount): still no numpy, and the same leaves."""
    path = tmp_path / "dcp"
    subprocess.run([sys.executable, "-c", _BIG_DCP, str(path)], check=True, timeout=300, capture_output=True)
    assert (path / ".metadata").stat().st_size > 128 << 10
    loaded = _loaded_after_inspect(str(path))
    assert not [m for m in loaded if m.split(".")[0] in ("numpy", "ml_dtypes", "tensorstore", "torch")]


def test_help_loads_no_format_package():
    code = (
        "import io, sys, contextlib, ckpt_tool.cli.main as m\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    m._run(['--help'])\n"
        "bad = [x for x in sys.modules if x.startswith('ckpt_tool.formats.') or x.split('.')[0] in"
        " ('numpy', 'tensorstore', 'rich', 'difflib')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


# what `ckpt --version` and `ckpt --help` load beyond a bare interpreter: the console script's own
# module and its exit codes (issue 46: within 1.5x of `python -c pass`, where click alone is 2x)
QUICK = {"ckpt_tool", "ckpt_tool.base.errors", "ckpt_tool.base.version", "ckpt_tool.cli", "ckpt_tool.cli.main",
         "ckpt_tool.cli.exits", "ckpt_tool.cli.tophelp", "__future__", "gc", "ckpt_tool.base"}


def _imported(code: str, env: dict[str, str]) -> tuple[set[str], str]:
    """(the modules `python -X importtime -c code` imports, its stdout)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    names = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    return names, r.stdout


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["-h"]])
def test_version_and_help_load_nothing_but_the_console_script(argv):
    """As the venv's console script runs them (its code: import main, call it), through a pipe:
    the modules loaded beyond what `python -c pass` loads are ckpt's few light ones (no click,
    typing, registry or command module)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    bare, _ = _imported("pass", env)
    loaded, out = _imported(f"import sys\nfrom ckpt_tool.cli.main import main\nsys.argv = ['ckpt', *{argv!r}]\nmain()",
                            env)
    assert loaded - bare <= QUICK, sorted(loaded - bare - QUICK)
    assert out.startswith("ckpt, version " if argv == ["--version"] else "Usage: ckpt [OPTIONS] COMMAND"), out[:200]


@pytest.mark.parametrize("columns", ["80", "200", "79", "50"])
def test_quick_help_and_version_are_clicks_own(columns):
    """The console script's `ckpt --help` and `--version` print what click prints, byte for byte
    (tophelp.py is click's rendering, regenerated by app.write_top_help()); on a terminal narrower
    than 80 columns click itself answers (it wraps to the width)."""
    from click.testing import CliRunner

    from ckpt_tool.cli import app, tophelp

    assert tophelp.TOP_HELP == app.render_top_help(), \
        "tophelp.py is stale: .venv/bin/python -c 'from ckpt_tool.cli.app import write_top_help; write_top_help()'"
    env = {**os.environ, "COLUMNS": columns}
    for argv in (["--help"], ["-h"], ["--version"]):
        quick = subprocess.run([sys.executable, "-m", "ckpt_tool", *argv], capture_output=True, text=True,
                               timeout=60, cwd=ROOT, env=env)
        clicks = subprocess.run([sys.executable, "-c", "import sys; from ckpt_tool.cli.app import cli; "
                                 "cli.main(sys.argv[1:], prog_name='ckpt')", *argv],
                                capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        assert (quick.returncode, quick.stdout, quick.stderr) == (clicks.returncode, clicks.stdout, clicks.stderr), argv
    assert CliRunner().invoke(app.cli, ["--help"]).exit_code == 0


# What a local Orbax -> Orbax reshard and a local Orbax -> DCP convert must not load, before their
# work or during it (issue 46: their process overhead on a TPU host): each is imported where the rare
# path that needs it runs, never at module level.
LAZY_FOR_LOCAL_WRITES = (
    "ckpt_tool.ops.hf_export",  # a Hugging Face model folder's companions (--like, a safetensors target)
    "ckpt_tool.storage.ocdbt_entries",  # the merge of several processes' OCDBT databases
    "tempfile",  # an object store's staged uploads
    "shutil", "bz2", "lzma",  # removing leftovers, a replaced DST, a failed run's output
    "secrets", "hmac", "random",  # writing an integrity manifest
    "hashlib", "ckpt_tool.machinery.integrity.hashing",  # sha256 of a manifest's files
    "urllib.parse", "ipaddress",  # (an OCDBT location is unescaped by ckpt itself)
    "glob",  # a host's devices looked for (--devices given: none)
    "zlib_ng", "gzip",  # CRC-32 (torch.save's, DCP's): an Orbax write needs only CRC-32C
    "ckpt_tool.machinery.dcp.reader", "ckpt_tool.machinery.torch_save.safe_pickle", "pickletools",  # DCP read
    "ckpt_tool.base.distributed",  # several processes (a flag or a launcher's variable: cli/options.may_join)
)
# loaded by the work itself: CRC-32 of a DCP's data files
NEEDED_BY = {"convert": {"zlib_ng", "gzip"}}


def _loaded_by_the_command(command: str, tmp_path) -> set[str]:
    src = str(fixture_path("orbax_ocdbt_zarr2"))
    if command == "reshard":
        argv = ["reshard", src, str(tmp_path / "out"), "--mesh", "data=1,model=1", "--devices", "1"]
    else:
        argv = ["convert", src, str(tmp_path / "out"), "--to", "dcp"]
    return set(modules_loaded_after(argv))


@pytest.mark.parametrize("command", ["reshard", "convert"])
def test_a_local_orbax_reshard_and_convert_load_no_rare_path_module(command, tmp_path):
    loaded = _loaded_by_the_command(command, tmp_path)
    # (a real write of the format asked for)
    assert ("ckpt_tool.formats.orbax.direct" if command == "reshard" else "ckpt_tool.formats.dcp.write") in loaded
    lazy = set(LAZY_FOR_LOCAL_WRITES) - NEEDED_BY.get(command, set())
    assert not sorted(loaded & lazy), sorted(loaded & lazy)
    # (listed after the work: what writing the DCP loaded, zlib-ng for its CRC-32s, is there)
    assert NEEDED_BY.get(command, set()) <= loaded


def test_a_local_orbax_to_dcp_convert_loads_no_tensorstore(tmp_path):
    """A local Orbax (zarr v2, OCDBT) -> DCP convert, as a whole process, never imports tensorstore
    (issue 46: ~80 ms of import on a TPU host): the preflight's walk of the source's OCDBT database
    (check_ocdbt) reads its manifest and nodes with ckpt's own decoder, as the reader does its
    chunks. It imported tensorstore for that walk alone."""
    loaded = set(_loaded_by_the_command("convert", tmp_path))
    assert "ckpt_tool.formats.dcp.write" in loaded and "ckpt_tool.machinery.arrays.checks" in loaded
    assert (tmp_path / "out" / ".metadata").is_file()
    assert not sorted(m for m in loaded if m.split(".")[0] == "tensorstore")


# A local Orbax -> Orbax reshard imports tensorstore nowhere: not for its write (its zarr metadata and
# 0-d values are ckpt's: formats/orbax/zarr_metadata.generate, direct.py; its small files written by
# the file system, storage/local_backend.write; its destination's kvstore never opened), nor for its
# source (the preflight's check_ocdbt walks the database with ckpt's own decoder; a plain .zarray or
# zarr.json is checked without tensorstore's parser, machinery/arrays/schema.py).
@pytest.mark.parametrize("fixture", ["orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3"])
def test_a_local_orbax_reshard_loads_no_tensorstore(fixture, tmp_path):
    """A whole reshard process of an Orbax source with 0-d values (zarr v2 and zarr3) runs no
    `import tensorstore` (each one it ran is shown by its call stack) and never loads it."""
    argv = ["reshard", str(fixture_path(fixture)), str(tmp_path / "out"), "--mesh", "data=1,model=1",
            "--devices", "1"]
    code = (
        "import builtins, io, contextlib, json, sys, traceback\n"
        "real, stacks = builtins.__import__, set()\n"
        "def hook(name, *a, **k):\n"
        "    if name.split('.')[0] == 'tensorstore':\n"
        "        stacks.add(tuple(f.name for f in traceback.extract_stack()[:-1]))\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = hook\n"
        "import ckpt_tool.cli.main as m\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = m._run({argv!r})\n"
        "print(json.dumps([code, 'tensorstore' in sys.modules, sorted(stacks)]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    code_, loaded, stacks = json.loads(r.stdout.strip().splitlines()[-1])
    assert code_ == 0 and (tmp_path / "out" / "manifest.ocdbt").exists()
    assert not stacks, stacks
    assert not loaded


def test_the_command_modules_import_no_rare_path_module():
    """Importing the modules of convert and reshard (and the Orbax reader and checks, DCP's writer)
    loads none of LAZY_FOR_LOCAL_WRITES, nor tensorstore (its OCDBT walk imports it when it runs)."""
    code = (
        "import sys\n"
        "import ckpt_tool.cli.main, ckpt_tool.cli.app, ckpt_tool.cli.reshard_cmd, ckpt_tool.cli.convert_cmd\n"
        "import ckpt_tool.ops.runs, ckpt_tool.ops.engine, ckpt_tool.ops.reshard, ckpt_tool.ops.preflight\n"
        "import ckpt_tool.ops.validate, ckpt_tool.ops.validate.integrity, ckpt_tool.ops.manifest\n"
        "from ckpt_tool import formats\n"
        "formats.get('orbax').module(), formats.get('orbax').checks(), formats.get('dcp').writer_module()\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = set(r.stdout.split())
    assert "ckpt_tool.formats.dcp.write" in loaded and "ckpt_tool.machinery.arrays.checks" in loaded
    bad = loaded & {*LAZY_FOR_LOCAL_WRITES, "tensorstore"}
    assert not bad, sorted(bad)


def test_a_one_process_run_is_known_without_the_distributed_module():
    """cli/options.may_join says no other process is asked for only where base/distributed's
    process_spec finds none: with nothing set, every variable process_spec reads is one may_join
    looks at (any other it reads only once one of those is set)."""
    from collections.abc import Iterator, Mapping

    from ckpt_tool.base import distributed
    from ckpt_tool.cli import main as cli_main, options

    read: list[str] = []

    class Recording(Mapping[str, str]):
        def __getitem__(self, key: str) -> str:
            read.append(key)
            raise KeyError(key)

        def __iter__(self) -> Iterator[str]:
            return iter(())

        def __len__(self) -> int:
            return 0

    spec = distributed.process_spec(None, None, None, env=Recording())
    assert not spec.requested and read
    assert set(read) <= {*cli_main.PROCESS_VARIABLES, options.DISTRIBUTED_CHOICE_VARIABLE}, read
    assert options.DISTRIBUTED_CHOICE_VARIABLE == distributed.CHOICE_VARIABLE


def _full_detect(storage: Storage) -> str:
    """What detection says when every format's reader decides (no claims pre-filter, no light module)."""
    for info in formats.registered():
        if _reader(info).detect(storage):
            return info.name
    return "(unknown)"


def _reader(info: formats.FormatInfo):
    """A format's reader module (DCP's is the shared DCP machinery's, whose detect its package gives)."""
    try:
        return importlib.import_module(f"{info.package}.reader")
    except ModuleNotFoundError:
        return info.module()


def _registry_detect(storage: Storage) -> str:
    try:
        return formats.detect(storage).NAME
    except UnknownFormatError:
        return "(unknown)"


def _directories() -> list:
    """Every fixture directory and its sub-directories two levels down (steps, items, roots)."""
    out = []
    for top in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        out.append(top)
        for sub in sorted(p for p in top.iterdir() if p.is_dir()):
            out.append(sub)
            out.extend(sorted(p for p in sub.iterdir() if p.is_dir()))
    return out


def test_cheap_detection_equals_the_readers_detection():
    seen = {}
    for path in _directories():
        storage = Storage.open(str(path))
        try:
            want = _full_detect(storage)
        except CkptError as exc:
            want = f"error: {type(exc).__name__}"
        try:
            got = _registry_detect(Storage.open(str(path)))
        except CkptError as exc:
            got = f"error: {type(exc).__name__}"
        assert got == want, path
        seen[want] = seen.get(want, 0) + 1
    # the comparison covered every format's own checkpoints, and directories that are none
    assert set(formats.REGISTRY) <= set(seen), seen
    assert seen.get("(unknown)", 0) > 0


def test_cheap_detection_flat_directories(tmp_path):
    """Flat directories the fixtures lack: loose msgpack files under names without a claim, a
    torch.save file beside a DCP, JSON and text files that belong to nobody."""
    cases = {
        "loose_state": [("state", "flax_to_bytes/state.msgpack")],
        "loose_numbered": [("params_7", "flax_to_bytes/state.msgpack")],
        "loose_suffix": [("weights.flax", "flax_to_bytes/state.msgpack")],
        "tmp_only": [("checkpoint_tmp", "flax_to_bytes/state.msgpack")],
        "dcp_and_pt": [(".metadata", "dcp_single/.metadata"), ("__0_0.distcp", "dcp_single/__0_0.distcp"),
                       ("extra.pt", "torch_state/" + next(p.name for p in (FIXTURES / "torch_state").iterdir()))],
        "nobody": [("config.json", "flax_to_bytes/state.msgpack"), ("README", None), ("_private", None)],
    }
    for case, files in cases.items():
        d = tmp_path / case
        d.mkdir()
        for name, source in files:
            if source is None:
                (d / name).write_text("not a checkpoint\n")
            else:
                shutil.copyfile(FIXTURES / source, d / name)
        assert _registry_detect(Storage.open(str(d))) == _full_detect(Storage.open(str(d))), case
    assert _registry_detect(Storage.open(str(tmp_path / "loose_state"))) == "msgpack"
    assert _registry_detect(Storage.open(str(tmp_path / "nobody"))) == "(unknown)"


def test_light_detect_names_match_the_readers():
    from ckpt_tool.formats.msgpack import detection as msgpack_detection
    from ckpt_tool.formats.orbax import reader as orbax_reader

    # msgpack's detect steps aside for orbax >= 0.5's tree file without importing the Orbax reader
    assert msgpack_detection.ORBAX_TREE_METADATA == orbax_reader.TREE_METADATA
