"""Damage: each damage class a format can suffer (catalogue.DAMAGE: missing file, truncated file,
wrong size, garbage metadata, path escape) on a copy of one of its fixtures gives its finding code
from `ckpt validate --strict` (--deep where only the data bytes are hit), exit 1, on one line of
the report naming the damaged file; `ckpt inspect` (if it reads that file) and `ckpt convert`
refuse in one stderr line and write nothing."""
from __future__ import annotations

import pytest

import catalogue as C
from ckpt_inproc import ckpt

DAMAGE = C.damage_cases()


def damage_is_reported(d: C.Damage, work, root=C.FIXTURES) -> None:  # noqa: ANN001
    path, rel = C.damaged_copy(d, work, root)
    step = ["--step", d.step] if d.step else []
    deep = ["--deep"] if d.deep else []
    r = ckpt("validate", "--strict", "--json", *deep, path, *step)
    assert r.returncode == 1, r.stdout + r.stderr
    findings = [f for f in r.json()["findings"] if f["code"] == d.code and f["severity"] == "error"]
    assert findings, (d.code, r.json()["findings"])
    name = rel.rsplit("/", 1)[-1]
    assert any(name in f["message"] or (f["file"] and (f["file"] in rel or name in f["file"]))
               for f in findings), findings
    # the text report: the finding on one line, with its code
    text = ckpt("validate", "--strict", *deep, path, *step)
    assert text.returncode == 1 and not text.stderr.strip()
    lines = [ln for ln in text.stdout.splitlines() if f"error {d.code}:" in ln]
    assert lines and all("\n" not in ln for ln in lines)
    # inspect reads metadata only: it may not see data damage; when it fails, one line
    r = ckpt("inspect", "--json", path, *step)
    assert r.returncode in (0, 1)
    if r.returncode == 1:
        assert len(r.stderr_lines) == 1, r.stderr
    # convert refuses the damaged source in one line and leaves nothing behind
    to = next(t for t in C.writable() if t != d.format)
    out = work / "out"
    out.mkdir()
    r = ckpt("convert", path, out / "dst", "--to", to, "--skip-unsupported", *step)
    assert r.returncode == 1, r.stdout
    assert len(r.stderr_lines) == 1 and "internal error" not in r.stderr, r.stderr
    assert not list(out.iterdir())


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.id for d in DAMAGE])
def test_damage_gives_its_finding(damage, tmp_path):
    damage_is_reported(damage, tmp_path)


@pytest.mark.parametrize("fmt", [f.name for f in C.registered()])
def test_every_damage_class_is_made_for_every_format(fmt):
    """A format lists each class it can suffer; a class it cannot suffer is named in NOT_APPLICABLE."""
    have = {d.cls for d in C.DAMAGE if d.format == fmt}
    missing = set(C.DAMAGE_CLASSES) - have - set(C.NOT_APPLICABLE.get(fmt, {}))
    assert not missing, f"{fmt}: no damage case for {sorted(missing)}"
