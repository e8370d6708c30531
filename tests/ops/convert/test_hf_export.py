"""A complete Hugging Face export (ops/hf_export.py): a model directory's config and tokenizer files carried
beside the safetensors output; `--like HF_DIR` checks the output against a reference model written by
transformers (names, shapes, dtypes after --rename/--unstack/--dtype), drops the output embedding a tied
reference does not store, copies its files, and the result loads with transformers' from_pretrained."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
BIN_SET = FIXTURES / "torch_hf_bin_sharded"  # transformers 4.57 .bin shards, tied embeddings stored twice


def run(*args) -> subprocess.CompletedProcess:  # noqa: ANN002
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same architecture saved by transformers 5 (safetensors; tied: no lm_head.weight stored),
    plus a tokenizer file, as a hub snapshot has."""
    sys.path.insert(0, str(FIXTURES))
    from gen_torch_save import llama_model

    d = tmp_path_factory.mktemp("ref") / "llama"
    model = llama_model()
    model.save_pretrained(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))
    return d


@pytest.mark.slow
def test_a_model_directory_brings_its_files(tmp_path):
    r = run("convert", BIN_SET, tmp_path / "out", "--to", "safetensors", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["companions"] == ["config.json", "generation_config.json"]
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (tmp_path / "out" / "config.json").read_bytes() == (BIN_SET / "config.json").read_bytes()
    # to a format that is not a Hugging Face directory: nothing but the checkpoint
    r = run("convert", BIN_SET, tmp_path / "dcp", "--to", "dcp")
    assert r.returncode == 0 and "config.json" not in os.listdir(tmp_path / "dcp")


@pytest.mark.slow
def test_like_a_tied_reference_drops_the_stored_output_embedding_and_loads(reference, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    r = run("convert", BIN_SET, tmp_path / "out", "--to", "safetensors", "--like", reference, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [s["leaf"] for s in doc["skipped"]] == ["lm_head.weight"] and doc["like_differences"] == []
    assert "tokenizer_config.json" in doc["companions"]
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        ["model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as out, \
            safe_open(str(reference / "model.safetensors"), "pt") as ref:
        assert sorted(out.keys()) == sorted(ref.keys())
    # transformers loads it, ties lm_head to the embedding, and holds the .bin's values
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    source = {}
    for f in sorted(BIN_SET.glob("*.bin")):
        source.update(torch.load(f, weights_only=True))
    for name, value in model.state_dict().items():
        assert torch.equal(value, source[name]), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_every_difference_is_listed_and_nothing_written(reference, tmp_path):
    r = run("convert", BIN_SET, tmp_path / "out", "--to", "safetensors", "--like", reference,
            "--rename", r"model/norm/=model/final_norm/", "--dtype", "bfloat16")
    assert r.returncode == 1
    listed = [line.strip() for line in r.stdout.splitlines()]
    assert "model.final_norm.weight: in the output, not in the reference" in listed
    assert "model.norm.weight: in the reference, not in the output" in listed
    # --dtype makes bfloat16 what the float32 reference's tensors are expected in (tests/ops/convert/test_exports_asked.py)
    assert len(listed) == 2  # the rename's two (lm_head: tied, dropped)
    [line] = r.stderr.strip().splitlines()
    assert "would not match the reference's tensors" in line and f"(and {len(listed) - 1} more: listed above)" in line
    assert not (tmp_path / "out").exists()
    r = run("convert", BIN_SET, tmp_path / "out", "--to", "safetensors", "--like", reference, "--json",
            "--rename", r"model/norm/=model/final_norm/")
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "like-mismatch" and len(error["details"]) == 2
    # --force-like writes it, saying what differs
    r = run("convert", BIN_SET, tmp_path / "out", "--to", "safetensors", "--like", reference, "--force-like",
            "--rename", r"model/norm/=model/final_norm/")
    assert r.returncode == 0 and "differs from --like model.final_norm.weight" in r.stdout


@pytest.mark.slow
def test_like_is_for_a_hugging_face_target(reference, tmp_path):
    r = run("convert", BIN_SET, tmp_path / "out", "--to", "dcp", "--like", reference)
    assert r.returncode == 2 and "--like makes a Hugging Face model directory: use it with --to safetensors" in r.stderr
    r = run("convert", BIN_SET, tmp_path / "out", "--to", "safetensors", "--force-like")
    assert r.returncode == 2 and "--force-like needs --like" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    r = run("convert", BIN_SET, tmp_path / "out", "--to", "safetensors", "--like", empty)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_unstack_rename_and_like_make_an_export_from_stacked_layers(reference, tmp_path):
    """A Megatron-shaped stack of the reference's own tensors (layers stacked on axis 0, other names),
    unstacked and renamed into the reference's names: --like passes and the values are the layers'."""
    import torch
    from safetensors.torch import load_file

    ref = load_file(reference / "model.safetensors")
    stacked = {}
    for part in ("self_attn.q_proj", "mlp.up_proj", "input_layernorm"):
        stacked[f"decoder.layers.{part}.weight"] = torch.stack([ref[f"model.layers.{i}.{part}.weight"] for i in (0, 1)])
    others = {k: v for k, v in ref.items() if not any(f".{p}." in k for p in ("self_attn.q_proj", "mlp.up_proj",
                                                                                "input_layernorm"))}
    torch.save({**stacked, **others}, tmp_path / "mcore.pt")
    r = run("convert", tmp_path / "mcore.pt", tmp_path / "out", "--to", "safetensors", "--like", reference,
            "--unstack", "decoder/layers/{i}/**", "--rename", "^decoder/layers/=model/layers/")
    assert r.returncode == 0, r.stdout + r.stderr
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(out) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(out[k].numpy(), ref[k].numpy())
