"""A short fuzz smoke per registered format: a few hundred mutants of its fixtures, made by the
fuzzing suite's own mutators (tests/fuzz_lib.py: byte-level and structure-aware operators, one
damaged file per mutant, reproducible from its seed), and `ckpt inspect --json`, `ckpt validate`
and `ckpt validate --deep` on each must keep the contract: no traceback or internal error, exit 0
or 1, one stderr line on failure, no hang. They run in this process (fuzz_lib.run_inprocess, with
a watchdog); a sample runs as whole forked processes (fuzz_lib.Zygote), where a signal shows.
The long run with the library oracle is `make fuzz`; the seeded subset with the oracle is
tests/fuzz/test_fuzz.py."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

import catalogue as C
import fuzz_lib as F

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

MUTANTS_PER_FORMAT = 75  # in-process, three commands each
FORKED_PER_FORMAT = 8  # as whole processes (validate --deep)
KILL_AFTER_S = 20.0


def specs_for(fmt: str, entries=None, root: Path = C.FIXTURES) -> list:  # noqa: ANN001
    """fuzz_lib's fixture specs of `fmt`; for a format it does not know yet, the catalogue's fixtures."""
    specs = [s for s in F.FIXTURE_SPECS if s.format == fmt]
    if specs:
        return specs
    return [F.FixtureSpec(e.path, fmt, None) for e in C.cases(entries=entries or C.ENTRIES)
            if e.format == fmt and (root / e.path).is_dir()]


def mutant(rng: random.Random, spec, work: Path, root: Path = C.FIXTURES) -> F.Mutant:  # noqa: ANN001
    if F.fixture_targets(root / spec.name) and root == C.FIXTURES:
        return F.make_mutant(rng, spec, work)
    # a fixture none of fuzz_lib's kinds recognises: byte-level damage to one of its files
    dst = work / Path(spec.name).name
    shutil.copytree(root / spec.name, dst, symlinks=True)
    files = sorted(p for p in dst.rglob("*") if p.is_file() and not p.is_symlink())
    target = rng.choice(files)
    new, desc = F.bytes_mutation(rng, target.read_bytes())
    if new is None:
        target.unlink()
    else:
        target.write_bytes(new)
    return F.Mutant(dst, spec.name, spec.format, "bytes", str(target.relative_to(dst)), desc, None)


def _violations(runs: list) -> list:  # noqa: ANN001
    return [v for r in runs for v in F.check_run(r) if v.cls != "slow"]  # slow: the shared machine's, not ckpt's


def smoke(fmt: str, work: Path, n: int, entries=None, root: Path = C.FIXTURES) -> list[str]:  # noqa: ANN001
    """n mutants of fmt's fixtures, in process; the contract breaches, as reproducible labels."""
    specs = specs_for(fmt, entries, root)
    assert specs, f"no fixture to fuzz for {fmt}"
    bad = []
    for i in range(n):
        rng = random.Random(f"conformance:{fmt}:{i}")
        spec = specs[i % len(specs)]
        with_dir = work / str(i)
        m = mutant(rng, spec, with_dir, root)
        runs = [F.run_inprocess(c, m.dir, kill_after=KILL_AFTER_S) for c in ("inspect", "validate", "deep")]
        for v in _violations(runs):
            bad.append(f"seed conformance:{fmt}:{i} {m.label()}: {v.cls} ({v.command}) {v.detail[:300]}")
        shutil.rmtree(with_dir, ignore_errors=True)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [f.name for f in C.registered()])
def test_fuzz_smoke_in_process(fmt, tmp_path):
    bad = smoke(fmt, tmp_path, MUTANTS_PER_FORMAT)
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def zygote():
    z = F.Zygote()
    yield z
    z.close()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [f.name for f in C.registered()])
def test_fuzz_smoke_whole_processes(fmt, zygote, tmp_path):
    specs = specs_for(fmt)
    bad = []
    for i in range(FORKED_PER_FORMAT):
        rng = random.Random(f"conformance-forked:{fmt}:{i}")
        m = mutant(rng, specs[i % len(specs)], tmp_path / str(i))
        r = zygote.run("deep", m.dir, kill_after=KILL_AFTER_S)
        for v in _violations([r]):
            if v.cls in F.PROCESS_CLASSES:  # confirmed as a fresh `python -m ckpt_tool`, as test_fuzz does
                fresh = F.run_process("deep", m.dir, kill_after=KILL_AFTER_S)
                if not _violations([fresh]):
                    continue
            bad.append(f"seed conformance-forked:{fmt}:{i} {m.label()}: {v.cls} {v.detail[:300]}")
    assert not bad, "\n".join(bad)
