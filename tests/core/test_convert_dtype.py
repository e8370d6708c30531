"""`convert --dtype` (core/casting.py, hf_export.retyped_configs): what a cast export holds, checked with the
libraries' own loaders.

- a transformers `save_pretrained` model cast to bfloat16 loads with `from_pretrained(DST)` (no dtype
  argument) as bfloat16, equal to torch's own `.to(torch.bfloat16)`: config.json's `dtype` (and the
  `torch_dtype` older transformers wrote) names the new dtype;
- a training state (torch.save, torch DCP, DeepSpeed, Megatron) keeps Adam's `step` counters exactly
  (a float32 10000 is 9984 in bfloat16) and every integer, bool and complex leaf, while the moments
  are cast; the summary says what was cast and what was kept.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEP = 10000.0  # exact in float32; bfloat16 (8 significant bits) rounds it to 9984


def _tiny_llama():  # noqa: ANN202 - a transformers model
    sys.path.insert(0, str(FIXTURES))
    from gen_torch_save import llama_model

    return llama_model()


def _trained(model, steps: int = 3):  # noqa: ANN001, ANN202 - torch objects
    """`steps` real Adam steps on `model`, then every parameter's step counter set to STEP."""
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum((p.float() ** 2).sum() for p in model.parameters())
        loss.backward()
        opt.step()
    for state in opt.state.values():
        state["step"] = torch.tensor(STEP)
    return opt


def _load_dcp(path: Path, tmp_path: Path) -> dict:
    """A DCP checkpoint as torch's own format_utils reads it (dcp_to_torch_save, then torch.load)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _at(tree: dict, path: str):  # noqa: ANN202 - a torch tensor
    """The leaf at a '/'-joined path of a nested state dict (an int key for a list's index)."""
    node = tree
    for key in path.split("/"):
        node = node[int(key) if isinstance(node, list) else key]
    return node


# -- a Hugging Face model directory ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])
def test_a_cast_hf_export_loads_in_the_new_dtype(ckpt, tmp_path, field):
    import torch
    from transformers import AutoModelForCausalLM

    model = _tiny_llama()
    src = tmp_path / "hf"
    model.save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    assert config["dtype"] == "float32"  # what transformers 5 writes
    if field == "torch_dtype":  # what transformers before 4.56 wrote (and 5 still reads)
        config["torch_dtype"] = config.pop("dtype")
        (src / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = (src / "generation_config.json").read_bytes()

    r = ckpt("convert", src, tmp_path / "out", "--to", "safetensors", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written[field] == "bfloat16"
    assert {k: v for k, v in written.items() if k != field} == {k: v for k, v in config.items() if k != field}
    # generation_config.json names no dtype: copied byte for byte
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == generation

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # no dtype argument: the config's
    expected = model.to(torch.bfloat16).state_dict()
    state = loaded.state_dict()
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    for name, value in state.items():
        assert torch.equal(value, expected[name]), name
    lines = r.stdout.splitlines()
    assert "cast 20 floating leaves to bfloat16" in lines
    assert f"set config.json {field} to bfloat16 (was float32)" in lines


@pytest.mark.slow
def test_the_json_summary_names_the_config_fields(ckpt, tmp_path):
    src = tmp_path / "hf"
    _tiny_llama().save_pretrained(src)
    r = ckpt("convert", src, tmp_path / "out", "--to", "safetensors", "--dtype", "float16", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dtype"] == "float16" and len(doc["cast"]) == 20 and doc["kept"] == []
    assert doc["config_dtype"] == [{"file": "config.json", "field": "dtype", "was": "float32", "now": "float16"}]


def test_a_config_that_is_not_json_is_refused_before_anything_is_written(ckpt, tmp_path):
    src = tmp_path / "hf"
    _tiny_llama().save_pretrained(src)
    (src / "config.json").write_text('{"dtype": "float32", ')  # cut short
    r = ckpt("convert", src, tmp_path / "out", "--to", "safetensors", "--dtype", "bfloat16")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(
        "config.json: not valid JSON, so --dtype cannot set its dtype (from_pretrained would not read it either)")
    assert not (tmp_path / "out").exists()
    assert [n for n in os.listdir(tmp_path) if n != "hf"] == []  # no temporary output left either


# -- training states -----------------------------------------------------------------------------


@pytest.mark.slow
def test_torch_save_training_state_keeps_steps_and_integer_leaves(ckpt, tmp_path):
    """torch.save of a model, its Adam state after 10000 steps and leaves of every kind, to DCP."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = _trained(model)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "logit_scale": torch.tensor(2.6592),  # a 0-d weight, not a counter: cast
        "token_ids": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "spectrum": torch.randn(3, dtype=torch.complex64),
    }
    src = tmp_path / "state.pt"
    torch.save(state, src)

    r = ckpt("convert", src, tmp_path / "out", "--to", "dcp", "--dtype", "bfloat16", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert sorted(doc["cast"]) == sorted(
        [f"model/{n}" for n in ("0/weight", "0/bias", "1/weight", "1/bias")]
        + [f"optimizer/state/{i}/{m}" for i in range(4) for m in ("exp_avg", "exp_avg_sq")]
        + ["logit_scale"])
    assert {(k["leaf"], k["dtype"], k["reason"]) for k in doc["kept"]} == {
        *((f"optimizer/state/{i}/step", "float32", "step-counter") for i in range(4)),
        ("token_ids", "int64", "not-floating"), ("mask", "bool", "not-floating"),
        ("spectrum", "complex64", "other-kind"),
    }

    out = _load_dcp(tmp_path / "out", tmp_path)
    for i, moments in state["optimizer"]["state"].items():
        got = out["optimizer"]["state"][i]
        assert got["step"].dtype == torch.float32 and got["step"].item() == STEP
        for name in ("exp_avg", "exp_avg_sq"):
            assert got[name].dtype == torch.bfloat16
            assert torch.equal(got[name], moments[name].to(torch.bfloat16)), (i, name)
    for name, value in state["model"].items():  # ("0.weight": a key per dotted part, as ckpt reads it)
        assert torch.equal(_at(out, "model/" + name.replace(".", "/")), value.to(torch.bfloat16)), name
    assert out["logit_scale"].dtype == torch.bfloat16
    for name in ("token_ids", "mask", "spectrum"):
        assert out[name].dtype == state[name].dtype and torch.equal(out[name], state[name]), name

    # the text summary: the counts by what each leaf is
    r = ckpt("convert", src, tmp_path / "text", "--to", "dcp", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert ("cast 13 floating leaves to bfloat16; kept 4 step counters, 2 non-floating leaves and "
            "1 complex leaf as they are") in r.stdout.splitlines()


def test_dcp_training_state_keeps_its_step_counters(ckpt, tmp_path):
    """torch's dcp.save of a model and its optimizer state dict keyed by parameter name
    (`optim.state.<fqn>.step`, as get_optimizer_state_dict gives it)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = _trained(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(tmp_path / "src"))

    r = ckpt("convert", tmp_path / "src", tmp_path / "out", "--to", "dcp", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    out = _load_dcp(tmp_path / "out", tmp_path)
    assert sorted(out["optim"]["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for fqn, moments in state["optim"]["state"].items():
        got = out["optim"]["state"][fqn]
        assert got["step"].dtype == torch.float32 and got["step"].item() == STEP, fqn
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name], moments[name].to(torch.bfloat16)), (fqn, name)
    assert out["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert "cast 12 floating leaves to bfloat16; kept 4 step counters as they are" in r.stdout.splitlines()


@pytest.mark.parametrize("name, steps", [
    ("deepspeed_z2_bf16", 14),  # optimizer/state/<param>/step: DeepSpeed's base optimizer's, per parameter
    ("megatron_torch_dist_fully_sharded", 17),  # optimizer/param_state/<n>/step
])
def test_deepspeed_and_megatron_steps_stay_float32(ckpt, tmp_path, name, steps):
    """The step counters torch's Adam keeps inside DeepSpeed's and Megatron's optimizer states,
    read back by torch from the DCP output: float32, the source's values."""
    import numpy as np
    import torch

    from ckpt_tool.formats import open_checkpoint

    r = ckpt("convert", FIXTURES / name, tmp_path / "out", "--to", "dcp", "--dtype", "bfloat16",
             "--skip-unsupported", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    counters = [k["leaf"] for k in doc["kept"] if k["reason"] == "step-counter"]
    assert len(counters) == steps and all(c.endswith("/step") for c in counters)
    assert not any(c.endswith("/step") for c in doc["cast"])
    assert any("exp_avg" in c.split("/") for c in doc["cast"])  # (Megatron: optimizer/state/exp_avg/<param>)

    source = {leaf.path: leaf for leaf in open_checkpoint(str(FIXTURES / name)).arrays()}
    out = _load_dcp(tmp_path / "out", tmp_path)
    for path in counters:
        node = _at(out, path)
        assert node.dtype == torch.float32, path
        assert node.numpy().tobytes() == np.asarray(source[path].read(), dtype=np.float32).tobytes(), path
