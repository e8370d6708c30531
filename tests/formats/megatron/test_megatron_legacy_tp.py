"""Legacy Megatron-LM saves (--ckpt-format torch, one model_optim_rng.pt per TP rank): the model's
tensors merged over the tensor-parallel ranks equal Megatron's OWN merge, recorded by
fixtures/gen_megatron.py as `tp_merged` (Megatron-LM's load_checkpoint of the save at TP 2,
dist_checkpointing.save of the model's sharded_state_dict, loaded by the same model at TP 1).

megatron_legacy_swiglu is the save whose layout is not the ranks concatenated: a gated MLP
(--swiglu: each rank's linear_fc1 is [gate_r; up_r], the whole one [gate_0; gate_1; up_0; up_1]),
grouped-query attention (2 query groups for 4 heads), an untied output layer and a padded vocabulary."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SWIGLU = FIXTURES / "megatron_legacy_swiglu"
LEGACY = FIXTURES / "megatron_legacy"


def _sha256(a: np.ndarray) -> str:
    # the reference hashes raw little-endian bytes; bfloat16 through its 16-bit pattern
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def _merged_reference(root: Path) -> dict[tuple[str, ...], dict]:
    doc = json.loads((root / "_reference.json").read_text())
    return {("model", *r["keys"]): r for r in doc["tp_merged"]}


@pytest.mark.parametrize("root", [SWIGLU, LEGACY], ids=lambda p: p.name)
def test_merged_model_equals_megatrons_own_tp_merge(root):
    import ckpt_tool

    ck = ckpt_tool.open(str(root))
    want = _merged_reference(root)
    got = {leaf.keys: leaf for leaf in ck.leaves if leaf.keys[0] == "model"}
    assert sorted(got) == sorted(want)
    for keys, ref in want.items():
        leaf = got[keys]
        assert (list(leaf.shape), leaf.dtype) == (ref["shape"], ref["dtype"]), keys
        assert _sha256(leaf.read()) == ref["sha256"], f"{'/'.join(keys)} differs from Megatron's TP merge"
    # nothing of the model is left per rank: every tensor was merged
    assert not [leaf.path for leaf in ck.leaves if leaf.keys[1:2] == ("model",) and leaf.kind == "array"]
    assert any("model tensors merged over 2 tensor-parallel ranks" in n for n in ck.notes)


def test_swiglu_layouts_recorded_per_tensor():
    """Which layout each tensor was merged with: the gated linear_fc1 (weight and bias) apart from the
    plainly column-parallel QKV of grouped-query attention, the padded vocabulary's embeddings and
    output layer (64 rows for 61 tokens), row-parallel linear_proj / linear_fc2 on axis 1."""
    import ckpt_tool

    ck = ckpt_tool.open(str(SWIGLU))
    split = {leaf.path: leaf.extra["tp_merged"]["split"] for leaf in ck.leaves if leaf.keys[0] == "model"}
    assert split["model/decoder/layers/0/mlp/linear_fc1/weight"] == "gated"
    assert split["model/decoder/layers/1/mlp/linear_fc1/bias"] == "gated"
    assert split["model/decoder/layers/0/self_attention/linear_qkv/weight"] == "axis 0"
    assert split["model/decoder/layers/0/mlp/linear_fc2/weight"] == "axis 1"
    assert split["model/decoder/layers/0/self_attention/linear_proj/bias"] == "replicated"
    shapes = {leaf.path: leaf.shape for leaf in ck.leaves if leaf.keys[0] == "model"}
    # GQA: 4 query heads + 2 k + 2 v heads of 4 = 32 rows; vocabulary 61 padded to 64
    assert shapes["model/decoder/layers/0/self_attention/linear_qkv/weight"] == (32, 16)
    assert shapes["model/embedding/word_embeddings/weight"] == shapes["model/output_layer/weight"] == (64, 16)
    assert sum(1 for s in split.values() if s == "gated") == 4
    assert any("every rank's gate half, then every rank's up half" in n for n in ck.notes)


def test_gated_fc1_regions_across_the_halves():
    """Regions that cross a rank's gate/up boundary or cut columns read what the whole tensor holds."""
    import ckpt_tool

    ck = ckpt_tool.open(str(SWIGLU))
    leaf = next(x for x in ck.leaves if x.path == "model/decoder/layers/1/mlp/linear_fc1/weight")
    whole = leaf.read()
    for rows, cols in ((slice(10, 40), slice(0, 16)), (slice(15, 49), slice(3, 11)), (slice(63, 64), slice(0, 1))):
        assert np.array_equal(leaf.read((rows, cols)).view(np.uint16), whole[rows, cols].view(np.uint16))
    assert leaf.chunk_count == 4  # gate_0, gate_1, up_0, up_1


def test_convert_writes_megatrons_merge(tmp_path, ckpt):
    """convert to safetensors, the engine reading in output chunks of 512 bytes (a quarter of a
    linear_fc1 weight, so reads inside and across the ranks' halves): every model tensor as Megatron
    merges it."""
    from safetensors.numpy import load_file

    out = tmp_path / "out"
    r = ckpt("convert", str(SWIGLU), str(out), "--to", "safetensors", "--select", "model/**",
             "--chunk-mb", str(512 / 2**20))
    assert r.returncode == 0, r.stderr
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    want = _merged_reference(SWIGLU)
    assert len(tensors) == len(want)
    for keys, ref in want.items():
        name = next(n for n in tensors if n.replace("/", ".") == ".".join(keys))
        assert _sha256(tensors[name]) == ref["sha256"], name


def test_a_rank_holding_another_shape_is_one_clear_line(tmp_path, ckpt):
    """mp_rank_01 from another run (swiglu's files beside megatron_legacy's rank 0): Megatron's strict
    load of one model refuses it; ckpt names the tensor and both shapes in one line."""
    root = tmp_path / "mixed"
    shutil.copytree(LEGACY, root)
    shutil.copyfile(SWIGLU / "iter_0000005" / "mp_rank_01" / "model_optim_rng.pt",
                    root / "iter_0000005" / "mp_rank_01" / "model_optim_rng.pt")
    r = ckpt("inspect", str(root))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert "mp_rank_01" in lines[0] and "model tensor" in lines[0], lines[0]
