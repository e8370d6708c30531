"""No false alarms: every good checkpoint the real writers made passes `validate --strict`.

A CI sanity check runs `ckpt validate --strict` on healthy saves; a warning
there breaks someone's build. Every committed fixture written by a real
library (all writers and versions, see fixtures/README.md) must validate with
no error and no warning, shallow and --deep. The one deliberately incomplete
save (orbax_manager's step 3) is validated by its committed steps.
"""
from __future__ import annotations

import pytest

from ckpt_tool.validate import validate_checkpoint

from conftest import FIXTURES

# directories under fixtures/ that are not one checkpoint of their own
_NOT_CHECKPOINTS = {"legacy_jax_reference"}
# families whose sub-directories are the checkpoints (one per save kind)
_FAMILIES = ("orbax_v0_5", "orbax_v0_9", "orbax_v0_11")


def _good_checkpoints() -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for d in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        if d.name in _NOT_CHECKPOINTS:
            continue
        if d.name in _FAMILIES:
            out += [(f"{d.name}/{s.name}", None) for s in sorted(d.iterdir()) if s.is_dir()]
        elif d.name == "orbax_manager":
            out += [(d.name, "1"), (d.name, "2")]  # step 3 is the fixture's interrupted save
        else:
            out.append((d.name, None))
    return out


GOOD = _good_checkpoints()


def test_the_list_covers_every_writer_family():
    names = {n.split("/")[0] for n, _ in GOOD}
    for prefix in ("orbax_v0_4", "orbax_v0_5", "orbax_v0_9", "orbax_v0_11", "flax_", "t5x", "dcp_", "safetensors_"):
        assert any(n.startswith(prefix) for n in names), prefix


@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
@pytest.mark.parametrize("name, step", GOOD, ids=[f"{n}@{s}" if s else n for n, s in GOOD])
def test_validate_strict_passes(name, step, deep):
    report = validate_checkpoint(str(FIXTURES / name), step=step, deep=deep)
    assert report.ok(True), [f.to_json() for f in report.findings]
