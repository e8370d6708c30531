"""The fuzzing suite's fast, seeded subset (the long run is fuzz/run_fuzz.py,
`make fuzz`).

Every mutant of every metadata and data file kind of the committed fixtures
(tests/fuzz_lib.py) must keep the contract for `ckpt inspect --json`,
`ckpt validate` and `ckpt validate --deep`, run as whole processes: no
traceback or `internal error`, exit 0 or 1, no signal, under 20 s, peak RSS
under 1 GB, one stderr line on failure; and wherever validate passes, the real
library (torch's DCP reader, orbax, safetensors, flax's msgpack restore, torch.load
of a torch.save file; tests/fuzz_oracle.py) loads the mutant
with the values ckpt reads. The explicit cases (hostile pickles, path tricks,
FIFOs, memory bombs; for DCP and torch.save, a hostile pickle) must be refused. tests/fuzz_corpus/ holds reproducers of
what the long run found.

The runs go through a zygote (a process that has imported ckpt and forks one
child per run: a whole process, ~0.1 s instead of ~0.7 s); every violation is
re-run as a fresh `python -m ckpt_tool` process before it counts, and a few
mutants always run as fresh processes. Hypothesis chooses the mutations,
derandomized: the same mutants on every run.

Cases that fail today because a fix in another part of the tree has not
landed are xfail(strict=False) below, each with its reason; the contract is
not weakened for them.
"""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fuzz_lib as F

pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"), pytest.mark.slow]

# (fixture, kind) groups: every metadata and data file kind of every fuzzed fixture
GROUPS = [(s.name, k) for s in F.FIXTURE_SPECS for k in sorted(F.fixture_targets(F.FIXTURES / s.name))]

# examples per group: DCP's pickled .metadata and zip archives have the most
# structure to get wrong; a commit marker has little. torch.save archives are three
# groups each (pickle, zip, storages) over four fixtures: the pickle gets the most
EXAMPLES = {"dcp_metadata": 6, "distcp": 4, "commit_marker": 1, "zarr_chunk": 3, "msgpack": 3,
            "torch_pickle": 3, "torch_storage": 1, "torch_index": 1}
DEFAULT_EXAMPLES = 2

# cases waiting on a fix: id -> reason, marked xfail(strict=False) so that a
# landed fix shows as XPASS
KNOWN_GROUPS: dict[tuple[str, str], str] = {}
KNOWN_CASES: dict[str, str] = {}
KNOWN_CORPUS: dict[str, str] = {}
KNOWN_FRESH: dict[tuple, str] = {}


def _params(items, known, ids):
    out = []
    for item, ident in zip(items, ids):
        reason = known.get(item)
        marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
        out.append(pytest.param(item, id=ident, marks=marks))
    return out


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("torch")
    pytest.importorskip("orbax.checkpoint")
    with F.Oracle() as o:
        yield o


@pytest.fixture(scope="module")
def zygote():
    z = F.Zygote()
    yield z
    z.close()


def _report(outcome: F.Outcome) -> str:
    lines = [f"mutant {outcome.mutant.label()}"]
    for v in outcome.violations:
        lines.append(f"  {v.cls} ({v.command}): {v.detail[:400]}")
    return "\n".join(lines)


@pytest.mark.parametrize("group", _params(GROUPS, KNOWN_GROUPS, [f"{f}-{k}" for f, k in GROUPS]))
def test_mutants_keep_the_contract(group, zygote, oracle, tmp_path):
    fixture, kind = group
    spec = F.SPECS[fixture]

    @settings(max_examples=EXAMPLES.get(kind, DEFAULT_EXAMPLES), derandomize=True, deadline=None,
              database=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(rng=st.randoms(use_true_random=False))
    def check(rng):
        with tempfile.TemporaryDirectory(dir=tmp_path) as work:
            m = F.make_mutant(rng, spec, Path(work), kind=kind)
            outcome, _ = F.evaluate_forked(m, zygote, oracle, kill_after=F.TIME_LIMIT_S + 1, confirm=False)
            assert not outcome.violations, _report(outcome)

    check()


# the object-graph and view changes of genuine torch.save files (shared references, a
# self-containing object, opcode-cheap memory, stride-0 and overlapping views), on a plain
# state dict and on the framework files whose readers walk the pickle (DeepSpeed's model
# states with its client state, Megatron's common.pt and legacy model_optim_rng.pt)
STRUCTURED_FILES = [("torch_state", "state.pt"), ("deepspeed_z2_bf16", "global_step2/mp_rank_00_model_states.pt"),
                    ("megatron_run", "iter_0000020/common.pt"),
                    ("megatron_legacy", "iter_0000005/mp_rank_00/model_optim_rng.pt")]
STRUCTURED = [(f, t, fam, var) for f, t in STRUCTURED_FILES
              for fam, variants in (("graph", F.GRAPH_VARIANTS), ("view", F.VIEW_VARIANTS)) for var in variants]
KNOWN_STRUCTURED: dict[tuple, str] = {}


@pytest.mark.parametrize("case", _params(STRUCTURED, KNOWN_STRUCTURED, [f"{f}-{v}" for f, _t, _fam, v in STRUCTURED]))
def test_structured_torch_mutants_keep_the_contract(case, zygote, oracle, tmp_path):
    fixture, target, family, variant = case
    for seed in range(2):
        work = tmp_path / str(seed)
        work.mkdir()
        m = F.structured_torch_mutant(random.Random(f"{fixture}:{variant}:{seed}"), F.SPECS[fixture], target,
                                      family, variant, work)
        outcome, _ = F.evaluate_forked(m, zygote, oracle, kill_after=F.TIME_LIMIT_S + 1, confirm=False)
        assert not outcome.violations, _report(outcome)


CASES = F.explicit_cases()


@pytest.mark.parametrize("case", _params(list(CASES), KNOWN_CASES, list(CASES)))
def test_explicit_case_is_refused(case, zygote, tmp_path):
    m = CASES[case](tmp_path)
    outcome, _ = F.evaluate_forked(m, zygote, None, kill_after=F.TIME_LIMIT_S + 1, confirm=False)
    assert not outcome.violations, _report(outcome)


# a few mutants as fresh `python -m ckpt_tool` processes, no zygote: what the
# zygote shows holds for the real entry point too
FRESH_SAMPLE = [("dcp_single", "dcp_metadata", 3), ("dcp_multirank", "distcp", 5),
                ("orbax_ocdbt_zarr2", "metadata", 2), ("orbax_plain_zarr2", "zarr_chunk", 4),
                ("safetensors_numpy", "safetensors", 1), ("torch_dcp_to_torch_save", "torch_pickle", 2)]


@pytest.mark.parametrize("sample", _params(FRESH_SAMPLE, KNOWN_FRESH, [f"{f}-{k}-{n}" for f, k, n in FRESH_SAMPLE]))
def test_fresh_process_sample(sample, oracle, tmp_path):
    fixture, kind, seed = sample
    m = F.make_mutant(random.Random(f"fresh:{seed}"), F.SPECS[fixture], tmp_path, kind=kind)
    outcome = F.evaluate(m, runner="process", oracle=oracle)
    assert all(r.rss_kb and r.rss_kb > 1024 for r in outcome.runs.values())  # measured, per child
    assert not outcome.violations, _report(outcome)


CORPUS_CASES = sorted(p.name for p in F.CORPUS.iterdir() if (p / "case.json").is_file()) if F.CORPUS.is_dir() else []


@pytest.mark.parametrize("name", _params(CORPUS_CASES, KNOWN_CORPUS, CORPUS_CASES))
def test_corpus_case(name, zygote, oracle, tmp_path):
    m = F.load_corpus_case(F.CORPUS / name, tmp_path)
    outcome, _ = F.evaluate_forked(m, zygote, oracle, kill_after=F.TIME_LIMIT_S + 1, confirm=False)
    assert not outcome.violations, _report(outcome)


FROZENSET_CASE = "accepted-bad-input-torch_torch_pickle_global_ordereddict_to_builtins_frozenset"


@pytest.mark.skipif(FROZENSET_CASE not in CORPUS_CASES, reason="corpus case not present")
def test_corpus_global_ckpt_admits_is_given_to_torch(zygote, oracle, tmp_path):
    # the long run's find (seed 13): a tensor's backward-hooks OrderedDict() turned into
    # builtins.frozenset(), which weights_only refuses by default and ckpt admits as data.
    # The rule: torch is given the real frozenset (as megatron-core and DeepSpeed give theirs
    # to torch.serialization.safe_globals), loads the file, and its values are ckpt's
    m = F.load_corpus_case(F.CORPUS / FROZENSET_CASE, tmp_path)
    outcome, _ = F.evaluate_forked(m, zygote, oracle, kill_after=F.TIME_LIMIT_S + 1, confirm=False)
    assert outcome.runs["deep"].exit_code == 0
    res = outcome.oracle
    assert res["library_ok"] and res["ckpt_ok"] and res["mismatch"] is None, res
    assert outcome.violations == [], _report(outcome)


# --- the harness itself: its checks can fail ---------------------------------


def test_contract_catches_each_violation_class():
    ok = F.RunResult("validate", 0, None, 0.1, 80_000, "", "")
    assert F.check_run(ok) == []
    bad = [
        (F.RunResult("validate", 1, None, 0.1, 80_000, "", "Traceback (most recent call last):\n  x\nValueError: y"),
         "internal-error"),
        (F.RunResult("validate", 1, None, 0.1, 80_000, "", "ckpt: internal error: KeyError: 1 (set ...)"),
         "internal-error"),
        (F.RunResult("deep", None, 7, 0.1, 80_000, "", ""), "signal"),
        (F.RunResult("deep", None, None, 30.0, 80_000, "", "", timed_out=True), "hang"),
        (F.RunResult("deep", 0, None, 21.0, 80_000, "", ""), "slow"),
        (F.RunResult("deep", 0, None, 1.0, 2_000_000, "", ""), "rss"),
        (F.RunResult("deep", 2, None, 1.0, 80_000, "", "x"), "bad-exit"),
        (F.RunResult("validate", 1, None, 1.0, 80_000, "", "ckpt: error: a\nmore\n"), "stderr-lines"),
        (F.RunResult("inspect", 0, None, 1.0, 80_000, "not json", ""), "inspect-json"),
    ]
    for r, cls in bad:
        assert cls in {v.cls for v in F.check_run(r)}, cls


def test_zygote_measures_whole_processes(zygote, tmp_path):
    # a real run of a fixture: exit 0, its own RSS, stdout captured
    m = F.copy_fixture("dcp_single", tmp_path / "dcp_single")
    r = zygote.run("inspect", m)
    assert r.exit_code == 0 and r.signal is None and r.rss_kb > 10_000
    assert '"format": "dcp"' in r.stdout
    # a missing path: exit 1 and one stderr line
    r = zygote.run("validate", tmp_path / "nope")
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1


def test_oracle_catches_a_library_rejection(oracle, tmp_path):
    # a damaged zstd chunk: orbax's restore fails; the oracle must say so
    m = F.copy_fixture("orbax_plain_zarr2", tmp_path / "orbax_plain_zarr2")
    chunk = m / "layers.1.w" / "0.0"
    chunk.write_bytes(chunk.read_bytes()[:-4])
    res = oracle.check("orbax", m)
    assert not res["library_ok"] and res["library_error"]
    # an undamaged fixture: loaded, and with the values ckpt reads
    m2 = F.copy_fixture("dcp_single", tmp_path / "dcp_single")
    assert oracle.check("dcp", m2)["mismatch"] is None


def test_oracle_never_gives_torch_a_hostile_pickle(oracle, tmp_path):
    m = F.copy_fixture("dcp_single", tmp_path / "dcp_single")
    canary = tmp_path / "CANARY"
    (m / ".metadata").write_bytes(F._hostile_pickles(canary)["os_system"])
    res = oracle.check("dcp", m)
    assert not res["library_ok"] and "foreign globals" in res["library_error"]
    assert not canary.exists()


def test_mutants_are_reproducible(tmp_path):
    import hashlib

    def tree_hash(root: Path) -> str:
        h = hashlib.sha256()
        for p in sorted(root.rglob("*")):
            if p.is_file():
                h.update(p.relative_to(root).as_posix().encode() + p.read_bytes())
        return h.hexdigest()

    before = tree_hash(F.FIXTURES / "dcp_single")
    a = F.make_mutant(random.Random("r:1"), F.SPECS["dcp_single"], tmp_path / "a", kind="dcp_metadata")
    b = F.make_mutant(random.Random("r:1"), F.SPECS["dcp_single"], tmp_path / "b", kind="dcp_metadata")
    assert a.description == b.description
    assert tree_hash(a.dir) == tree_hash(b.dir)
    assert tree_hash(a.dir) != before  # a mutant differs from its fixture...
    assert tree_hash(F.FIXTURES / "dcp_single") == before  # ...which is never touched


# --- torch.save: the archive rewriter and the oracle --------------------------

TORCH_FILES = ["torch_state/state.pt", "torch_dcp_to_torch_save/full.pt", "torch_hf_bin_single/pytorch_model.bin",
               "torch_hf_bin_sharded/pytorch_model-00002-of-00003.bin"]


def test_torch_archives_are_rewritten_as_torch_writes_them():
    import io
    import zipfile

    import torch

    for rel in TORCH_FILES:
        data = (F.FIXTURES / rel).read_bytes()
        tz = F.parse_torch_zip(data)
        assert tz is not None and tz.write() == data, rel  # parsed and written back byte for byte
        assert len(F.tensor_sites(F._ops(tz.member("data.pkl").data))) >= 7, rel  # every tensor's view found
        # data.pkl grown by one memo store: sizes, offsets, 64-byte padding and CRC-32 rewritten
        pkl = tz.member("data.pkl").data
        new = F.with_torch_pickle(data, pkl[:2] + b"N0" + pkl[2:])  # (NONE, POP: the same object)
        assert zipfile.ZipFile(io.BytesIO(new)).testzip() is None
        out = F.parse_torch_zip(new)
        assert all(m.data_at % 64 == 0 for m in out.storages())
        assert torch.load(io.BytesIO(new), weights_only=False).keys() == torch.load(io.BytesIO(data)).keys()


def test_oracle_compares_torch_values(oracle, tmp_path):
    import fuzz_oracle

    m = F.copy_fixture("torch_state", tmp_path / "torch_state")
    res = oracle.check("torch", m)
    assert res["library_ok"] and res["ckpt_ok"] and res["mismatch"] is None, res
    before = fuzz_oracle.torch_library_values(str(m))
    # a storage byte changed and its CRC-32 rewritten: a valid file with other values, which
    # torch and ckpt must both read
    f = m / "state.pt"
    tz = F.parse_torch_zip(f.read_bytes())
    s = tz.member("data/0")
    s.data = bytes([s.data[0] ^ 0x40]) + s.data[1:]
    s.crc = F._crc(s.data)
    f.write_bytes(tz.write())
    assert fuzz_oracle.compare(before, fuzz_oracle.torch_library_values(str(m))) is not None
    res = oracle.check("torch", m)
    assert res["library_ok"] and res["ckpt_ok"] and res["mismatch"] is None, res


def _torch_file_with_value(path: Path, value_pickle: bytes) -> Path:
    """A torch.save file of {"w": a tensor, "z": <value_pickle>}: torch writes it with a
    placeholder string, whose opcode is then replaced (the archive rewritten as torch writes it)."""
    import torch

    torch.save({"w": torch.arange(3.0), "z": "Z_PLACEHOLDER"}, path)
    data = path.read_bytes()
    pkl = F.torch_pickle_bytes(data)
    placeholder = b"X\x0d\x00\x00\x00Z_PLACEHOLDER"  # BINUNICODE
    assert pkl.count(placeholder) == 1
    path.write_bytes(F.with_torch_pickle(data, pkl.replace(placeholder, value_pickle)))
    return path


def test_oracle_gives_torch_the_globals_ckpt_admits(oracle, zygote, tmp_path):
    import numpy as np
    import torch

    # torch.save writes a numpy array, a numpy scalar and a path through globals weights_only
    # refuses by default and ckpt admits as data: the oracle loads it as megatron-core does,
    # with the real numpy/pathlib objects given to torch.serialization.safe_globals, and
    # compares the values
    d = tmp_path / "np"
    d.mkdir()
    torch.save({"w": torch.ones(2), "a": np.arange(3), "s": np.float32(2.5), "f": frozenset({1, 2}), "b": b"xy",
                "p": __import__("pathlib").PurePosixPath("a/b")}, d / "x.pt")
    res = oracle.check("torch", d)
    assert res["library_ok"] and res["ckpt_ok"] and res["mismatch"] is None, res
    m = F.Mutant(d, "np", "torch", "torch_pickle", "x.pt", "numpy array", "torch")
    ok = {c: F.RunResult(c, 0, None, 0.1, 1000, "", "") for c in ("validate", "deep")}
    assert F.check_oracle(m, ok, oracle)[0] == []
    # a dtype alias torch.float (the object torch.float32, which torch names only that way):
    # given as the real dtype, and ckpt's value is the same dtype
    f = _torch_file_with_value(d / "x.pt", b"ctorch\nfloat\n")
    res = oracle.check("torch", d)
    assert res["library_ok"] and res["ckpt_ok"] and res["mismatch"] is None, res
    # (the comparison can fail: the value torch gave against another dtype)
    import fuzz_oracle

    lib = fuzz_oracle.torch_library_values(str(f))
    assert lib["z"] == "torch.float32"
    assert fuzz_oracle.compare(lib, {**lib, "z": "torch.float64"}) is not None
    # a global neither torch nor ckpt admits: both refuse; validate passing it would be a hole
    _torch_file_with_value(d / "x.pt", b"cargparse\nNamespace\n)R")
    res = oracle.check("torch", d)
    assert res["refused_globals"] == ["argparse.Namespace"] and not res["ckpt_ok"], res
    [v], _ = F.check_oracle(m, ok, oracle)
    assert v.cls == "accepted-bad-input" and "neither" in v.detail
    assert zygote.run("validate", d).exit_code == 1
    # a pickle weights_only cannot parse (protocol 4: SHORT_BINUNICODE, FRAME, ...) but whose
    # globals it allows is loaded without weights_only: torch.save writes such files
    torch.save({"w": torch.arange(4.0), "s": "x"}, d / "x.pt", pickle_protocol=4)
    res = oracle.check("torch", d)
    assert res["library_ok"] and res["ckpt_ok"] and res["mismatch"] is None, res


def test_oracle_leaves_unchecked_a_global_it_cannot_import(oracle, zygote, tmp_path, monkeypatch):
    import fuzz_oracle

    # DeepSpeed's ZeroStageEnum: ckpt admits it as data (an int 0-3); deepspeed is not
    # installed for the oracle, so torch cannot be given it: no verdict, said in the answer,
    # and not a violation although validate passes the file
    d = tmp_path / "ds"
    d.mkdir()
    _torch_file_with_value(d / "x.pt", b"cdeepspeed.runtime.zero.config\nZeroStageEnum\nK\x02\x85R")
    m = F.Mutant(d, "ds", "torch", "torch_pickle", "x.pt", "a DeepSpeed global", "torch")
    outcome, _ = F.evaluate_forked(m, zygote, oracle, kill_after=F.TIME_LIMIT_S + 1, confirm=False)
    assert outcome.runs["validate"].exit_code == 0 and outcome.runs["deep"].exit_code == 0
    assert outcome.violations == [], _report(outcome)
    assert outcome.oracle["unchecked"] == ["deepspeed.runtime.zero.config.ZeroStageEnum"], outcome.oracle
    assert outcome.to_json()["oracle"]["unchecked"]  # in the run record
    # a made-up module on a format's allow-list: the same (the worker's rule, in this process)
    base = fuzz_oracle.ckpt_allow()
    monkeypatch.setattr(fuzz_oracle, "ckpt_allow", lambda fmt="torch": base | {("made_up.module", "Thing")})
    _torch_file_with_value(d / "x.pt", b"cmade_up.module\nThing\nK\x02\x85R")
    res = fuzz_oracle.check("torch", str(d), "", "torch")
    assert res["unchecked"] == ["made_up.module.Thing"] and not res["library_ok"], res
    # ...while without it on the list, torch's refusal stands (refused_globals)
    monkeypatch.setattr(fuzz_oracle, "ckpt_allow", lambda fmt="torch": base)
    res = fuzz_oracle.check("torch", str(d), "", "torch")
    assert res["refused_globals"] == ["made_up.module.Thing"] and "unchecked" not in res, res
