"""A model in huggingface_hub's cache opens as the checkpoint it is (not as a path escape).

`from_pretrained("org/name")` keeps a model at <cache>/models--org--name/snapshots/<revision>/, whose
files are links to ../../blobs/<hash>. Every link out of a checkpoint used to be refused as a path
escape, so the place transformers keeps every model it downloads could not be inspected, validated
or converted. A snapshot (or a folder in it) may now read its own repository's blobs, and nothing
else outside itself. The cache here is written by the real huggingface_hub (hf_hub_download from a
stand-in for the Hub, tests/conftest.py), the model by transformers (the committed fixture).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, hub_download_env

MODEL = FIXTURES / "safetensors_llama_sharded"
FILES = ["config.json", "model.safetensors.index.json"] + [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)]


def _ckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def snapshot(fake_hub, tmp_path) -> Path:
    """The fixture fetched by huggingface_hub into a cache directory: its snapshot folder."""
    fake_hub["src"] = MODEL
    cache = tmp_path / "hub"
    code = ("import sys\nfrom huggingface_hub import hf_hub_download\n"
            "for f in sys.argv[3:]:\n    print(hf_hub_download('me/tiny', f, cache_dir=sys.argv[2], endpoint=sys.argv[1]))\n")
    env = hub_download_env(tmp_path)
    r = subprocess.run([sys.executable, "-c", code, fake_hub["url"], str(cache), *FILES], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    folder = Path(r.stdout.split()[0]).parent
    # huggingface_hub's own layout: links into the repository's blobs
    assert folder.parent.name == "snapshots" and folder.parent.parent.name == "models--me--tiny"
    assert all((folder / f).is_symlink() and (folder / f).resolve().parent.name == "blobs" for f in FILES)
    return folder


def test_a_snapshot_in_the_hub_cache_reads_as_its_checkpoint(snapshot, tmp_path):
    r = _ckpt("inspect", str(snapshot), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "safetensors" and doc["status"] == "committed"
    r = _ckpt("validate", str(snapshot), "--deep")
    assert r.returncode == 0, r.stdout + r.stderr
    # the values are the model's: the same as the folder transformers wrote
    r = _ckpt("diff", str(MODEL), str(snapshot), "--values")
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "dcp"
    r = _ckpt("convert", str(snapshot), str(out), "--to", "dcp")
    assert r.returncode == 0, r.stderr
    # torch's own DCP load of the output holds what the safetensors library reads from the snapshot
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.numpy import load_file

    expected = {}
    for f in FILES[2:]:
        expected.update(load_file(snapshot / f))
    state = {k: torch.empty_like(torch.from_numpy(v)) for k, v in expected.items()}
    dcp.load(state, checkpoint_id=str(out))
    assert all((state[k].numpy() == v).all() for k, v in expected.items())


def test_a_snapshot_link_anywhere_else_is_still_refused(snapshot, tmp_path):
    """Only the repository's own blobs: a link to another file outside the snapshot (here another
    repository's blob, and a file beside the cache) is the path escape it always was."""
    other = snapshot.parent.parent.parent / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    target = snapshot / FILES[3]
    (other / "abc").write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(other / "abc")
    r = _ckpt("inspect", str(snapshot))
    assert r.returncode == 1 and "outside the checkpoint" in r.stderr, r.stdout + r.stderr
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((other / "abc").read_bytes())
    target.unlink()
    target.symlink_to(outside)
    r = _ckpt("validate", str(snapshot))
    assert r.returncode == 1 and "outside the checkpoint" in r.stdout + r.stderr, r.stdout + r.stderr
