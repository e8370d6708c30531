"""A Hugging Face model trained under DeepSpeed ZeRO-3, exported by ckpt and loaded by transformers
(issue 21): fixtures/deepspeed_z3_hf_llama is a transformers LlamaForCausalLM (tied embeddings)
trained 2 steps under ZeRO-3 bf16 on 2 gloo ranks by real DeepSpeed, saved with
engine.save_checkpoint, its config.json (model.config.save_pretrained) beside `latest` as the HF
Trainer's checkpoint-N/ holds it. `ckpt convert ROOT OUT --to safetensors` (the optimizer and
engine state excluded) carries config.json over; transformers loads OUT with nothing missing,
unexpected or mismatched, and its state dict is zero_to_fp32's output (recorded in DeepSpeed's
venv) value for value. Runs in the test venv: no DeepSpeed needed.
"""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from conftest import FIXTURES, run_ckpt

NAME = "deepspeed_z3_hf_llama"
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]


def zero_to_fp32() -> dict[str, np.ndarray]:
    doc = json.loads((FIXTURES / NAME / "_reference.json").read_text())
    assert doc["writer"]["deepspeed"].startswith("0.19") and doc["facts"]["stage"] == 3
    return {t["name"]: np.frombuffer(base64.b64decode(t["data"]), dtype=t["dtype"]).reshape(t["shape"])
            for t in doc["zero_to_fp32"]}


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_transformers_loads_the_export(tmp_path, dtype):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    r = run_ckpt("convert", str(FIXTURES / NAME), str(out), "--to", "safetensors", "--exclude", "optimizer/**",
                 "--exclude", "engine/**", *(["--dtype", dtype] if dtype else []))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_bytes() == (FIXTURES / NAME / "config.json").read_bytes()
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    want = zero_to_fp32()
    got = model.state_dict()
    assert sorted(got) == sorted(want)  # lm_head.weight too: transformers ties it to the embedding
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name, value in want.items():
        tensor = got[name].detach()
        if dtype is None:
            assert tensor.dtype == torch.float32 and tensor.numpy().tobytes() == value.tobytes(), name
        else:  # ckpt's cast is torch's round-to-nearest-even of zero_to_fp32's output
            assert tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, torch.from_numpy(value.copy()).to(torch.bfloat16)), name
    # and it runs: the logits of the loaded model are finite
    with torch.no_grad():
        logits = model(input_ids=torch.arange(8).reshape(1, 8)).logits
    assert logits.shape == (1, 8, 64) and torch.isfinite(logits.float()).all()


def test_like_a_model_directory(tmp_path):
    """Without config.json beside `latest`: `--like HF_DIR` (here transformers' own save_pretrained of
    the model) checks the names, shapes and dtypes, leaves out the tied lm_head.weight the reference
    does not store, and copies its config files."""
    pytest.importorskip("transformers")
    import shutil

    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / NAME, run)
    (run / "config.json").unlink()
    first = tmp_path / "first"
    assert run_ckpt("convert", str(FIXTURES / NAME), str(first), "--to", "safetensors", "--exclude", "optimizer/**",
                    "--exclude", "engine/**").returncode == 0
    AutoModelForCausalLM.from_pretrained(str(first)).save_pretrained(str(tmp_path / "ref"))
    out = tmp_path / "hf"
    r = run_ckpt("convert", str(run), str(out), "--to", "safetensors", "--exclude", "optimizer/**", "--exclude",
                 "engine/**", "--like", str(tmp_path / "ref"))
    assert r.returncode == 0, r.stderr
    assert "skipped lm_head.weight: tied to the input embedding" in r.stdout
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    want = zero_to_fp32()
    for name, tensor in model.state_dict().items():
        assert tensor.detach().numpy().tobytes() == want[name].tobytes(), name
