"""`--weights fp32|module` on DeepSpeed ZeRO checkpoints (issue 21): a reader option the registry
declares (FormatInfo.read_options), passed by inspect, validate, diff and convert, and refused by
name for every format that does not take it.

`module` gives the module state dict the model-states file holds: at stages 1/2 every parameter
whole in the training dtype (fp32, bf16 or fp16), the buffers as stored, each tied name as its own
entry; compared here with torch.load of that file in DeepSpeed's venv (fixtures/gen_deepspeed.py
records it as `module` in each _reference.json). At stage 3 DeepSpeed saves empty placeholders
there (the reference shows 0 elements for each parameter on every rank): refused in one line.
"""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from conftest import FIXTURES, run_ckpt

from ckpt_tool import formats

STAGE12 = ["deepspeed_z1_fp32", "deepspeed_z1_bf16", "deepspeed_z2_fp32", "deepspeed_z2_bf16", "deepspeed_z2_fp32_dp4",
           "deepspeed_z1_bf16_dp4", "deepspeed_z1_fp16", "deepspeed_z2_fp16"]
STAGE3 = ["deepspeed_z3_fp32", "deepspeed_z3_bf16", "deepspeed_z3_bf16_dp4", "deepspeed_z3_fp16",
          "deepspeed_z3_hf_llama"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "_reference.json").read_text())


def recorded(t: dict) -> np.ndarray:
    import ml_dtypes

    dt = np.dtype(getattr(ml_dtypes, t["dtype"], None) or t["dtype"])
    return np.frombuffer(base64.b64decode(t["data"]), dtype=dt).reshape(t["shape"])


def model_leaves(path, weights: str | None):  # noqa: ANN001, ANN201
    with formats.read_options(weights=weights):
        ck = formats.open_checkpoint(str(path))
    return ck, [leaf for leaf in ck.arrays() if leaf.keys[0] not in ("optimizer", "engine")]


@pytest.mark.parametrize("name", STAGE12)
def test_module_weights_are_the_model_states_module(name):
    """Every entry of torch.load(mp_rank_00_model_states.pt)["module"], in its order, dtype and bytes."""
    want = reference(name)["module"]["mp_rank_00_model_states.pt"]
    ck, leaves = model_leaves(FIXTURES / name, "module")
    assert ck.layout["weights"] == "module"
    assert [leaf.name for leaf in leaves] == [t["name"] for t in want]
    precision = ck.layout["precision"]
    for leaf, t in zip(leaves, want):
        assert (list(leaf.shape), leaf.dtype) == (t["shape"], t["dtype"]), leaf.name
        got = leaf.read()
        assert got.tobytes() == recorded(t).tobytes(), leaf.name
    # the trained parameters in the training dtype: not the fp32 master weights
    dtypes = {leaf.name: leaf.dtype for leaf in leaves}
    assert dtypes["embed.weight"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
    # the optimizer and engine state are the same as with the fp32 weights
    _, fp32 = model_leaves(FIXTURES / name, None)
    ck_fp32 = formats.open_checkpoint(str(FIXTURES / name))
    rest = [(leaf.name, leaf.shape, leaf.dtype) for leaf in ck.leaves if leaf.keys[0] in ("optimizer", "engine")]
    assert rest == [(leaf.name, leaf.shape, leaf.dtype) for leaf in ck_fp32.leaves
                    if leaf.keys[0] in ("optimizer", "engine")]


@pytest.mark.parametrize("name", ["deepspeed_z2_bf16", "deepspeed_z3_bf16_dp4"])
def test_fp32_is_the_default(name):
    _, default = model_leaves(FIXTURES / name, None)
    _, fp32 = model_leaves(FIXTURES / name, "fp32")
    assert [(leaf.name, leaf.dtype) for leaf in default] == [(leaf.name, leaf.dtype) for leaf in fp32]
    assert {leaf.dtype for leaf in fp32 if leaf.extra.get("kind") == "parameter"} == {"float32"}


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGE3)
def test_stage3_module_weights_are_refused_in_one_line(name):
    """DeepSpeed's stage-3 model states hold 0-element placeholders of every parameter (the
    reference, torch.load of each rank's file, shows it): nothing to give, so refused."""
    ref = reference(name)
    trained = set(ref["fp32_params"])
    for file, entries in ref["module"].items():
        held = [t for t in entries if t["name"] in trained]
        assert len(held) == len(trained) and all(t["shape"] == [0] for t in held), file
    for command in (["inspect"], ["validate", "--deep"]):
        r = run_ckpt(*command, str(FIXTURES / name), "--weights", "module")
        assert r.returncode == 2, r.stdout + r.stderr
        assert "placeholders" in r.stderr and "--weights fp32" in r.stderr and "Traceback" not in r.stderr


def test_the_shallow_checks_take_it_as_a_parameter():
    """validate hands the option to the format's checks as open_checkpoint hands it to read(), a
    keyword argument (no context variable read inside the format package; issue 47)."""
    from ckpt_tool.base.errors import UsageError
    from ckpt_tool.base.findings import Findings
    from ckpt_tool.storage import Storage

    checks = formats.get("deepspeed").checks()
    storage = Storage.open(str(FIXTURES / "deepspeed_z3_bf16"))
    findings = Findings()
    checks.check_path(storage, findings)  # fp32, the default: read
    assert not findings.errors
    with pytest.raises(UsageError, match="placeholders"):  # stage 3's module weights: refused
        checks.check_path(storage, Findings(), weights="module")


@pytest.mark.slow
def test_convert_module_weights_to_safetensors(tmp_path):
    from safetensors.torch import load_file

    name = "deepspeed_z2_fp16"
    out = tmp_path / "out"
    r = run_ckpt("convert", str(FIXTURES / name), str(out), "--to", "safetensors", "--weights", "module",
                 "--exclude", "optimizer/**", "--exclude", "engine/**")
    assert r.returncode == 0, r.stderr
    got = load_file(str(out / "model.safetensors"))
    want = reference(name)["module"]["mp_rank_00_model_states.pt"]
    assert sorted(got) == sorted(t["name"] for t in want)
    for t in want:
        tensor = got[t["name"]]
        assert str(tensor.dtype).removeprefix("torch.") == t["dtype"]
        assert tensor.numpy().tobytes() == recorded(t).tobytes(), t["name"]


@pytest.mark.slow
def test_validate_and_diff_take_it():
    path = str(FIXTURES / "deepspeed_z1_bf16_dp4")
    r = run_ckpt("validate", path, "--weights", "module", "--deep", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_ckpt("diff", path, path, "--weights", "module", "--values")
    assert r.returncode == 0 and "same" in r.stdout, r.stdout + r.stderr
    # both sides take it: the 4-rank and 2-rank saves of the same model have the same module tree
    r = run_ckpt("diff", path, str(FIXTURES / "deepspeed_z1_bf16"), "--weights", "module")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("command", [["inspect"], ["validate"], ["diff", "SELF"], ["convert", "OUT", "--to", "dcp"]])
def test_other_formats_refuse_it_by_name(command, tmp_path):
    path = str(FIXTURES / "dcp_single")
    args = [a.replace("SELF", path).replace("OUT", str(tmp_path / "out")) for a in command]
    r = run_ckpt(args[0], path, *args[1:], "--weights", "module")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--weights applies to DeepSpeed checkpoints" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_universal_output_refuses_module_weights(tmp_path):
    r = run_ckpt("convert", str(FIXTURES / "deepspeed_z1_bf16"), str(tmp_path / "uc"), "--to", "deepspeed-universal",
                 "--weights", "module")
    assert r.returncode == 1 and "fp32 master weights" in r.stderr, r.stderr
    assert not (tmp_path / "uc").exists()


def test_the_registry_declares_it():
    assert formats.reading("weights") == [formats.get("deepspeed").label]
    assert all(not f.read_options for f in formats.registered() if f.name != "deepspeed")
    with formats.read_options(weights=None):
        assert formats.given_read_options() == {}
    with formats.read_options(weights="module"):
        assert formats.given_read_options() == {"weights": "module"}
    assert formats.given_read_options() == {}


@pytest.mark.parametrize("name", ["deepspeed_z1_bf16", "deepspeed_z2_bf16", "deepspeed_z1_bf16_dp4", "deepspeed_z1_fp16",
                                  "deepspeed_z2_fp16"])
def test_module_weights_are_the_master_weights_rounded(name):
    """DeepSpeed copies each step's fp32 master weights into the 16-bit parameters (round to nearest
    even): the module copy is the master weights' cast, and not the master weights themselves."""
    import ml_dtypes

    _, fp32 = model_leaves(FIXTURES / name, None)
    _, module = model_leaves(FIXTURES / name, "module")
    by_name = {leaf.name: leaf for leaf in module}
    moved = 0
    for leaf in fp32:
        if leaf.extra.get("kind") != "parameter":
            continue
        master, half = leaf.read(), by_name[leaf.name].read()
        cast = master.astype(ml_dtypes.bfloat16 if half.dtype.name == "bfloat16" else np.float16)
        assert half.tobytes() == cast.tobytes(), leaf.name
        moved += int((half.astype(np.float32) != master).any())
    assert moved  # the 16-bit copy is not the master weights
