"""The orbax-saved source the stored-chunk tests share (test_orbax_stored_chunks, test_orbax_stored_copy).

jax and orbax are imported inside, when a test builds the source: importing this module is free.
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts


def save_sharded_source(path: Path, zarr3: bool) -> Path:
    """orbax saves, from arrays sharded over a 4x2 mesh of the 8 CPU devices: 'w' (float32,
    P('data', 'model'): chunks of 1 MiB), 'e' (bfloat16, P('data'): chunks of 300 x 1800, 1.03 MiB,
    each shard split over its 2 replicas) and 'host' (a host numpy array, one chunk)."""
    jax = pytest.importorskip("jax")
    ocp = pytest.importorskip("orbax.checkpoint")
    if jax.device_count() != 8:
        pytest.skip("needs 8 CPU devices (jax was initialised before XLA_FLAGS was set)")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(11)
    tree = {
        "w": jax.device_put(rng.standard_normal((2000, 1024)).astype(np.float32), NamedSharding(mesh, P("data", "model"))),
        "e": jax.device_put(rng.standard_normal((2400, 1800)).astype(ml_dtypes.bfloat16), NamedSharding(mesh, P("data"))),
        "host": rng.standard_normal((300, 200)).astype(np.float32),
    }
    handler = ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)
    with ocp.Checkpointer(handler) as ck:
        ck.save(str(path), args=ocp.args.PyTreeSave(tree))
    return path


def ocdbt_values(path: Path) -> dict[bytes, bytes]:
    """Every key of an orbax checkpoint's OCDBT database and its stored bytes, read by tensorstore."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    return {bytes(k): bytes(kv.read(k).result().value) for k in kv.list().result()}
