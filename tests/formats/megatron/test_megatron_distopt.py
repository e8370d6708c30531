"""Megatron-Core 0.13's distributed optimizer state (`fully_sharded_model_space`: flattened ranges,
stored nd-reformulated with `mcore_data`) against megatron's own loads, on the shapes
megatron_torch_dist_fully_sharded leaves out (fixtures/gen_megatron_distopt.py): DP 4 with ranges
ending inside tensors at non-row boundaries, several buckets with padding, GQA + SwiGLU (linear_fc1
cut in two by megatron's factory), RoPE, tied embeddings, 3 stacked layers, bf16 and fp32 models,
MoE experts (an expert axis after the layer axis) under two chained optimizers, pipeline parallel
(PP 2: each stage's layers at its offset, tied embeddings across stages; PP 2 x VPP 2: two model
chunks per stage, interleaved layers, two grad buffers), learned absolute positions, RMSNorm,
a partial distributed optimizer (2 instances), an fp16 model at TP 2 x PP 2.

Each tensor ckpt reads must equal, byte for byte, both megatron's whole-tensor
`dist_checkpointing.load` and what megatron's DistributedOptimizer holds after loading the save at
TP 1 x DP 1 (`_reference.json` `optimizer_load`); so must every sub-region of it, whatever path the
reformulated reader takes (whole rows, a band of rows, row by row)."""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DISTOPT = ["megatron_distopt_dp4", "megatron_distopt_tp2_dp2", "megatron_distopt_moe", "megatron_distopt_pp2_dp2",
           "megatron_distopt_vpp", "megatron_distopt_instances", "megatron_distopt_fp16_tp2_pp2",
           "megatron_distopt_moe_etp2"]
STATES = ("exp_avg", "exp_avg_sq", "fp32_param")


def _reference(path: Path) -> dict:
    return json.loads((path / "_reference.json").read_text())


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.mark.parametrize("name", DISTOPT)
def test_every_tensor_equals_megatrons_loads(name):
    import ckpt_tool

    path = FIXTURES / name
    ref = _reference(path)
    whole = {r["keys"][0]: r for r in ref["saves"]["."]["leaves"]}
    optimizer = {r["keys"][0]: r for r in ref["optimizer_load"]}
    # megatron's load at the save's own layout (a resume), where the fixture records it
    same_layout = {r["keys"][0]: r for r in ref.get("optimizer_load_same_layout", [])}
    ck = ckpt_tool.open(str(path))
    arrays = {leaf.name: leaf for leaf in ck.leaves if leaf.kind == "array" and leaf.name in whole}
    assert set(arrays) == set(whole)
    # every model param has its three states (MoE: two chained optimizers, `chained_0.` dense and
    # `chained_1.` experts), all of them read back as their logical tensors
    params = {k for k in whole if ".optimizer.state." not in f".{k}"}
    states = {k for k in whole if ".optimizer.state." in f".{k}"}
    assert {k.split("optimizer.state.", 1)[1] for k in states} == {f"{s}.{p}" for s in STATES for p in params}
    if name.startswith("megatron_distopt_moe"):  # megatron cannot load it at EP 1 (gen_megatron_distopt.py)
        assert {k.split(".")[0] for k in states} == {"chained_0", "chained_1"} and not optimizer
    else:
        assert set(optimizer) == states
    assert not same_layout or set(same_layout) == states
    for key, leaf in sorted(arrays.items()):
        got = leaf.read()
        assert list(got.shape) == whole[key]["shape"] and str(leaf.dtype) == whole[key]["dtype"], key
        assert _sha(got) == whole[key]["sha256"], key
        if key in optimizer:
            assert _sha(got) == optimizer[key]["sha256"], key
        if key in same_layout:
            assert _sha(got) == same_layout[key]["sha256"], key


@pytest.mark.parametrize("name", DISTOPT)
def test_regions_of_flattened_range_tensors(name, monkeypatch):
    """Any box of a reformulated tensor is that box of the whole; with no read slack, the reader
    takes its band and row-by-row paths on these small rows too."""
    import ckpt_tool
    from ckpt_tool.formats.megatron import reformulated

    ck = ckpt_tool.open(str(FIXTURES / name))
    leaves = [leaf for leaf in ck.leaves if leaf.kind == "array" and "reformulated" in leaf.extra]
    stored = _reference(FIXTURES / name)["saves"]["."]["leaves"]
    assert len(leaves) == sum(".optimizer.state." in f".{r['keys'][0]}" for r in stored)
    rng = random.Random(0)
    for slack in (reformulated._SLACK, 0):
        monkeypatch.setattr(reformulated, "_SLACK", slack)
        for leaf in leaves:
            full = leaf.read()
            for _ in range(8):
                box = []
                for d in leaf.shape:
                    a = rng.randrange(d)
                    box.append(slice(a, rng.randrange(a + 1, d + 1)))
                assert np.array_equal(leaf.reader(tuple(box)), full[tuple(box)]), (leaf.name, box)


def test_dp_ranges_end_inside_rows():
    """The fixture holds what it claims: DP ranks' flattened ranges that end inside a row of a 2-D
    block, blocks cut by more than one rank, and buckets with padding."""
    ref = _reference(FIXTURES / "megatron_distopt_dp4")
    md = ref["saves"]["."]["dcp_state_dict_metadata"]
    fc1 = md["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"]
    hidden = ref["spec"]["hidden"]
    cuts = [offsets[-1] for offsets, _ in fc1["chunks"] if offsets[-1]]
    assert cuts and any(c % hidden for c in cuts)
    buckets = ref["optimizer_buffer_layout"][0]["buffers"][0]["buckets"]
    assert len(buckets) > 2 and any(b["numel"] != b["numel_unpadded"] for b in buckets)
