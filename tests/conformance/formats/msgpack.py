"""Flax / T5X msgpack: the catalogue rows (tests/conformance/rows.py) of ckpt_tool/formats/msgpack:
flax 0.7.5 / orbax 0.4.1 / t5x's restores, recorded in fixtures/legacy_jax_reference/ (gen_legacy_jax.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from conftest import FIXTURES
from references import Ref, np_dtype
from rows import Damage, Entry, FixtureSpec

LEGACY = FIXTURES / "legacy_jax_reference"


def legacy_recorded(name: str) -> Callable[[Path, str | None], dict]:
    """fixtures/legacy_jax_reference/<name>.json: flax 0.7.5 / orbax 0.4.1's restore (gen_legacy_jax.py).

    As tests/formats/msgpack/test_legacy_jax.py reads it: orbax 0.4 keeps Python step / lr as 0-d arrays in its
    target-less restore (ckpt gives the numbers saved), t5x keeps `version` beside the state, and
    flax's restore of an orbax save turns list indices into str keys.
    """

    def load(path: Path, step: str | None = None) -> dict:
        doc = json.loads((LEGACY / f"{name}.json").read_text())
        out = {}
        for leaf in doc["leaves"]:
            keys = tuple(leaf["keys"])
            if leaf["kind"] == "array":
                ref = Ref("array", tuple(leaf["shape"]), leaf["dtype"])
                if name.startswith("orbax_v0_4") and keys[-1] in ("step", "lr") and ref.shape == ():
                    ref = Ref("value")
                out[keys] = ref
            else:
                out[keys] = Ref("value")
        if name.startswith("t5x"):
            out[("version",)] = Ref("value")
        return out

    load.__name__ = f"legacy_recorded[{name}]"
    return load


def legacy_recorded_values(name: str) -> Callable[[Path, str | None], dict]:
    """legacy_jax_reference/<name>.json + .npz, with legacy_recorded's adjustments."""

    def load(path: Path, step: str | None = None) -> dict:
        import numpy as np

        doc = json.loads((LEGACY / f"{name}.json").read_text())
        arrays = np.load(LEGACY / f"{name}.npz")
        out = {}
        for leaf in doc["leaves"]:
            keys = tuple(leaf["keys"])
            if leaf["kind"] == "array":
                raw = arrays[leaf["npz"]].tobytes()
                value = np.frombuffer(raw, dtype=np_dtype(leaf["dtype"])).reshape(leaf["shape"])
                if name.startswith("orbax_v0_4") and keys[-1] in ("step", "lr") and value.shape == ():
                    value = value.item()
                out[keys] = value
            else:
                out[keys] = leaf["value"]
        if name.startswith("t5x"):
            out[("version",)] = 3
        return out

    load.__name__ = f"legacy_recorded_values[{name}]"
    return load



def _LEGACY(name: str) -> dict:  # noqa: N802 - reads as the loader it gives
    return {"reference": legacy_recorded(name), "values": legacy_recorded_values(name)}


ENTRIES: list[Entry] = [
    # flax 0.7.5 / orbax 0.4.1 / t5x's calls (gen_legacy_jax.py): recorded restores
    Entry("orbax_v0_4_ocdbt", "msgpack", **_LEGACY("orbax_v0_4_ocdbt")),
    Entry("orbax_v0_4_plain", "msgpack", **_LEGACY("orbax_v0_4_plain")),
    Entry("orbax_v0_4_manager", "msgpack", **_LEGACY("orbax_v0_4_manager.1"), step="1"),
    Entry("orbax_v0_4_manager", "msgpack", **_LEGACY("orbax_v0_4_manager.2"), step="2"),
    Entry("flax_orbax", "msgpack", **_LEGACY("flax_orbax.1"), step="1", str_keys=True),
    Entry("flax_orbax", "msgpack", **_LEGACY("flax_orbax.2"), step="2", str_keys=True),
    Entry("flax_msgpack", "msgpack", **_LEGACY("flax_msgpack.1"), step="1"),
    Entry("flax_msgpack", "msgpack", **_LEGACY("flax_msgpack.2"), step="2"),
    Entry("flax_msgpack/checkpoint_1", "msgpack", **_LEGACY("flax_msgpack.1")),  # one file, by its path
    Entry("flax_to_bytes/state.msgpack", "msgpack", **_LEGACY("flax_to_bytes")),
    Entry("flax_chunked", "msgpack", **_LEGACY("flax_chunked")),
    Entry("t5x", "msgpack", **_LEGACY("t5x.1")),
]

DAMAGE: list[Damage] = [
    # msgpack: a Flax msgpack file, a T5X array chunk
    Damage("msgpack", "missing-file", "t5x", "checkpoint_1/target.encoder.token_embedder.embedding/0.0",
           "remove", "missing-chunk"),
    Damage("msgpack", "truncated-file", "flax_msgpack", "checkpoint_2", "truncate", "truncated-file"),
    Damage("msgpack", "truncated-file", "t5x", "checkpoint_1/target.encoder.token_embedder.embedding/0.0",
           "truncate", "bad-chunk", deep=True),
    Damage("msgpack", "wrong-size", "flax_msgpack", "checkpoint_2", "grow", "bad-metadata"),
    Damage("msgpack", "garbage-metadata", "flax_msgpack", "checkpoint_2", "garbage", "bad-metadata"),
    Damage("msgpack", "path-escape", "t5x", "checkpoint_1/target.encoder.token_embedder.embedding/0.0",
           "symlink-out", "path-escape"),
    Damage("msgpack", "path-escape", "flax_msgpack", "checkpoint_2", "symlink-out", "path-escape"),
]

NOT_CHECKPOINTS = {"legacy_jax_reference"}  # the recorded restores themselves

FUZZ = [
    # flax is not installed: orbax's msgpack_utils.msgpack_restore (flax's loader) is the oracle
    FixtureSpec("flax_msgpack", "msgpack", "msgpack"),
]
FUZZ_WEIGHT = {"msgpack": 0.03}
