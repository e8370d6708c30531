"""`convert --unstack`: stacked layers (Megatron's decoder.layers.*, Flax nn.scan) split into one leaf per
index, compared with torch's own unstacking (tensor[i] / torch.unbind), through every writer; nested specs
(experts inside layers); an axis other than 0; each stored chunk read once however many layers it holds;
and every spec mistake refused in one line before anything is written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run(*args) -> subprocess.CompletedProcess:  # noqa: ANN002
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    """A Megatron-shaped state dict saved by torch: layers stacked on axis 0, experts on axis 1."""
    import torch

    torch.manual_seed(0)
    sd = {
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(3, 4, 5),
        "decoder.layers.input_layernorm.weight": torch.randn(3, 5).to(torch.bfloat16),
        "decoder.layers.mlp.experts.weight1": torch.randn(3, 2, 5, 6),
        "embedding.word_embeddings.weight": torch.randn(7, 5),
    }
    d = tmp_path_factory.mktemp("stacked")
    torch.save(sd, d / "stacked.pt")
    return d / "stacked.pt", sd


def _torch_unstacked(sd: dict) -> dict:
    """torch's own unstacking: torch.unbind over the layer axis, then over the experts axis."""
    import torch

    out = {}
    for name, t in sd.items():
        if not name.startswith("decoder.layers."):
            out[name] = t
            continue
        rest = name[len("decoder.layers."):]
        for i, layer in enumerate(torch.unbind(t, 0)):
            if rest.startswith("mlp.experts."):
                for e, expert in enumerate(torch.unbind(layer, 0)):
                    out[f"decoder.layers.{i}.mlp.experts.{e}.{rest[len('mlp.experts.'):]}"] = expert
            else:
                out[f"decoder.layers.{i}.{rest}"] = layer
    return out


def _numpy(t):  # noqa: ANN001, ANN202
    import torch

    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


SPECS = ["--unstack", "decoder/layers/{i}/**", "--unstack", "decoder/layers/*/mlp/experts/{i}/**"]


@pytest.mark.slow
@pytest.mark.parametrize("to", ["safetensors", "dcp", "orbax"])
def test_unstacked_leaves_are_what_torch_unbind_gives(stacked, to, tmp_path):
    import ckpt_tool

    src, sd = stacked
    r = run("convert", src, tmp_path / "out", "--to", to, *SPECS)
    assert r.returncode == 0, r.stderr
    want = _torch_unstacked(sd)
    got = {leaf.name if to != "orbax" else ".".join(map(str, leaf.keys)): leaf for leaf in
           ckpt_tool.open(str(tmp_path / "out")).leaves}
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        a = got[name].read()
        b = _numpy(t)
        assert a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    assert run("validate", "--deep", "--strict", tmp_path / "out").returncode == 0


def test_axis_and_rename_after_unstacking(stacked, tmp_path):
    """'{i:1}' unstacks axis 1; --rename sees the unstacked keys (a scanned Flax tree's layers_N)."""
    import ckpt_tool

    src, sd = stacked
    r = run("convert", src, tmp_path / "out", "--to", "safetensors", "--select", "decoder/layers/mlp/experts/**",
            "--unstack", "decoder/layers/mlp/experts/{i:1}/**", "--rename", r"experts/(\d+)/=experts_\1/")
    assert r.returncode == 0, r.stderr
    leaves = {leaf.name: leaf for leaf in ckpt_tool.open(str(tmp_path / "out")).leaves}
    assert sorted(leaves) == ["decoder.layers.mlp.experts_0.weight1", "decoder.layers.mlp.experts_1.weight1"]
    t = sd["decoder.layers.mlp.experts.weight1"]
    np.testing.assert_array_equal(leaves["decoder.layers.mlp.experts_1.weight1"].read(), t[:, 1].numpy())


@pytest.mark.slow
def test_each_stored_chunk_is_read_once(tmp_path, monkeypatch):
    """An Orbax array of 8 layers in ONE compressed zarr chunk, unstacked into 8 leaves: the chunk is
    decoded once (the engine asks the stored leaf for each layer's region; the scheduler groups them)."""
    import ckpt_tool
    from ckpt_tool.ops import engine, streaming
    from ckpt_tool.ops.engine import ConvertOptions

    r = run("convert", ROOT / "fixtures" / "torch_state" / "state.pt", tmp_path / "orbax", "--to", "orbax",
            "--select", "model/transposed")
    assert r.returncode == 0, r.stderr
    [leaf] = ckpt_tool.open(str(tmp_path / "orbax")).arrays()
    assert leaf.shape == (8, 6) and leaf.chunk_count == 1
    made = []

    class Recording(streaming.Scheduler):
        def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(streaming, "Scheduler", Recording)
    engine.convert(str(tmp_path / "orbax"), str(tmp_path / "st"),
                   ConvertOptions(to="safetensors", unstack=["model/{i}/**"]))
    [scheduler] = made
    assert len(scheduler.wants) == 8
    assert dict(scheduler.stats.decodes) == {(leaf.path, 0): 1}, scheduler.stats.decodes
    assert len(ckpt_tool.open(str(tmp_path / "st")).leaves) == 8


@pytest.mark.parametrize("spec, message", [
    ("decoder/layers/**", "needs exactly one '{i}' component"),
    ("**/{i}/x", "must each be one key"),
    ("decoder/layers/{i}", "needs a pattern after it"),
    ("nothing/{i}/**", "matches none of the 4 leaves"),
    ("embedding/word_embeddings/{i:2}/**", "no axis 2 to unstack"),
])
def test_spec_mistakes_are_refused_in_one_line(stacked, spec, message, tmp_path):
    src, _ = stacked
    r = run("convert", src, tmp_path / "out", "--to", "safetensors", "--unstack", spec)
    lines = r.stderr.strip().splitlines()
    if r.returncode == 2:  # the spec itself is malformed: a usage error, as click reports them
        assert lines[-1].startswith("Error: --unstack") and message in lines[-1], r.stderr
    else:  # it does not fit this checkpoint: one line, exit 1
        assert r.returncode == 1 and len(lines) == 1 and message in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_value_matched_is_refused_or_skipped(tmp_path):
    import torch

    torch.save({"layers": {"w": torch.ones(2, 3), "n": 3}}, tmp_path / "v.pt")
    r = run("convert", tmp_path / "v.pt", tmp_path / "out", "--to", "dcp", "--unstack", "layers/{i}/**")
    assert r.returncode == 1 and "a value, not an array" in r.stderr
    r = run("convert", tmp_path / "v.pt", tmp_path / "out", "--to", "dcp", "--unstack", "layers/{i}/**",
            "--skip-unsupported", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [s["leaf"] for s in doc["skipped"]] == ["layers/n"] and doc["arrays"] == 2
