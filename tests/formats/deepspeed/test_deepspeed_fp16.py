"""DeepSpeed fp16 training (issue 21): fixtures/deepspeed_z{1,2,3}_fp16, written by real DeepSpeed
0.19 on its CPU accelerator (fp16 where torch's mkldnn supports it) with dynamic loss scaling.
The files carry no prefix (zero_pp_rank_R_mp_rank_00_optim_states.pt, as fp32 training's), the
module state is float16 and the optimizer states hold DeepSpeed's DynamicLossScaler (admitted by
name as data; optimizer/loss_scaler in the tree). The consolidated weights are zero_to_fp32's, value for value (its output recorded
in DeepSpeed's venv; the conformance suite also converts them through every writer).
"""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from conftest import FIXTURES

from ckpt_tool import formats

FP16 = ["deepspeed_z1_fp16", "deepspeed_z2_fp16", "deepspeed_z3_fp16"]


@pytest.mark.parametrize("name", FP16)
def test_fp16_checkpoint_reads_as_zero_to_fp32(name):
    doc = json.loads((FIXTURES / name / "_reference.json").read_text())
    files = sorted(p.name for p in (FIXTURES / name / "global_step2").iterdir())
    assert not any(f.startswith("bf16_") for f in files)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in files
    ck = formats.open_checkpoint(str(FIXTURES / name))
    assert formats.layout_text(ck) == (f"DeepSpeed ZeRO-{doc['facts']['stage']} (global_step2, 2 data-parallel ranks, "
                                       "fp16 training)")
    assert "loss scale 256 (dynamic)" in ck.notes
    leaves = {leaf.name: leaf for leaf in ck.arrays()}
    for t in doc["zero_to_fp32"]:
        want = np.frombuffer(base64.b64decode(t["data"]), dtype=t["dtype"]).reshape(t["shape"])
        got = leaves[t["name"]].read()
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), t["name"]
    # the loss scaler and its flags, as values (rank 0's; the conformance suite compares every field)
    values = {leaf.name: leaf.load() for leaf in ck.leaves if leaf.kind != "array" and leaf.keys[0] == "optimizer"}
    scaler = values["optimizer.loss_scaler"]
    assert (scaler.cur_scale, scaler.dynamic, scaler.cur_iter, repr(scaler.dtype)) == (256, True, 2, "torch.float16")
    assert values["optimizer.dynamic_loss_scale"] is True and values["optimizer.overflow"] is False
    # the master weights are not the fp16 copy: some value differs from its float16 rounding
    embed = leaves["embed.weight"].read()
    assert embed.dtype == np.float32 and (embed.astype(np.float16).astype(np.float32) != embed).any()
