"""Leaf filters (issue 18, item 5): one glob for inspect/diff --filter and
convert/reshard --select/--exclude, matching the '/'-joined keys or the dotted
flat name; a pattern that matches no leaf is exit 1 with one line in every command.

The expected leaf sets come from the files themselves (safetensors' own
`safe_open` names, the index), not from ckpt.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import ckpt_tool
from ckpt_tool.cli.main import _run

from conftest import fixture_path

LLAMA = fixture_path("safetensors_llama_sharded")
ORBAX = fixture_path("orbax_ocdbt_zarr2")
FSDP2 = fixture_path("dcp_fsdp2_adam")


def _cli(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) through the CLI's own error handling, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _run([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def _llama_names() -> dict[str, np.ndarray]:
    """Every tensor of the sharded HF fixture by its safetensors name, read by safetensors itself."""
    out = {}
    for f in sorted(LLAMA.glob("*.safetensors")):
        with safe_open(str(f), "np") as s:
            for name in s.keys():
                out[name] = s.get_tensor(name)
    return out


LAYER0 = sorted(n for n in json.loads((LLAMA / "model.safetensors.index.json").read_text())["weight_map"]
                if n.startswith("model.layers.0."))


def _names(doc: dict) -> list[str]:
    return sorted(leaf["name"] for leaf in doc["leaves"])


# --- the dotted form -------------------------------------------------------------


def test_inspect_dotted_hf_pattern_selects_layer_0():
    assert len(LAYER0) == 9  # the fixture: 9 tensors in layer 0, 21 in all
    code, out, err = _cli("inspect", LLAMA, "--json", "--filter", "model.layers.0.*")
    assert code == 0, err
    assert _names(json.loads(out)) == LAYER0


def test_inspect_dotted_pattern_does_not_match_layer_10_or_the_key_form_differently():
    # the '/' form and the dotted form of the same selection agree
    _, slash, _ = _cli("inspect", LLAMA, "--json", "--filter", "model/layers/0/**")
    _, dots, _ = _cli("inspect", LLAMA, "--json", "--filter", "model.layers.0.*")
    assert _names(json.loads(slash)) == _names(json.loads(dots)) == LAYER0
    # `*` after a literal '.0.' never reaches layer 1
    _, one, _ = _cli("inspect", LLAMA, "--json", "--filter", "model.layers.1.self_attn.*")
    assert _names(json.loads(one)) == sorted(n for n in _llama_names() if n.startswith("model.layers.1.self_attn."))


def test_slash_form_keeps_star_within_one_key():
    # unchanged: in the '/' form `*` stays within one key, `**` spans keys
    code, out, _ = _cli("inspect", ORBAX, "--json", "--filter", "params/*")
    assert code == 0
    leaves = json.loads(out)["leaves"]
    assert leaves and all(len(leaf["keys"]) == 2 and leaf["keys"][0] == "params" for leaf in leaves)


def test_orbax_nested_keys_match_their_dotted_name():
    code, out, err = _cli("inspect", ORBAX, "--json", "--filter", "params.dense.*")
    assert code == 0, err
    assert [leaf["keys"] for leaf in json.loads(out)["leaves"]] == [["params", "dense", "bias"], ["params", "dense", "kernel"]]


def test_keys_holding_dots_match_in_both_forms():
    # torch FQN keys such as '0.weight' (DCP state dict of an nn.Sequential): a dot inside a key
    want = [["optim", "state", "0.weight", k] for k in ("exp_avg", "exp_avg_sq", "step")]
    for pattern in ("optim.state.0.weight.*", "optim/state/0.weight/*"):
        code, out, err = _cli("inspect", FSDP2, "--json", "--filter", pattern)
        assert code == 0, (pattern, err)
        assert sorted(leaf["keys"] for leaf in json.loads(out)["leaves"]) == want, pattern


def test_python_api_filtered_takes_both_forms():
    ck = ckpt_tool.open(str(LLAMA))
    assert sorted(leaf.name for leaf in ck.filtered("model.layers.0.*")) == LAYER0
    assert sorted(leaf.name for leaf in ck.filtered("model/layers/0/**")) == LAYER0
    assert ck.filtered("model.layrs.0.*") == []  # the API filters; the commands refuse


def test_diff_dotted_filter(tmp_path):
    dst = tmp_path / "as_dcp"
    code, _, err = _cli("convert", LLAMA, dst, "--to", "dcp")
    assert code == 0, err
    code, out, err = _cli("diff", LLAMA, dst, "--values", "--json", "--filter", "model.layers.0.*")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["same"] and doc["compared"] == len(LAYER0)


def test_convert_dotted_select(tmp_path):
    dst = tmp_path / "layer0"
    code, _, err = _cli("convert", LLAMA, dst, "--to", "safetensors", "--select", "model.layers.0.*")
    assert code == 0, err
    tensors = _llama_names()
    got = {}
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "np") as s:  # the output read back by safetensors itself
            for name in s.keys():
                got[name] = s.get_tensor(name)
    assert sorted(got) == LAYER0
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, tensors[name])


def test_convert_dotted_exclude(tmp_path):
    dst = tmp_path / "no_mlp"
    code, _, err = _cli("convert", LLAMA, dst, "--to", "dcp", "--exclude", "model.layers.*.mlp.*")
    assert code == 0, err
    names = sorted(leaf.name for leaf in ckpt_tool.open(str(dst)).leaves)
    assert names == sorted(n for n in _llama_names() if ".mlp." not in n)
    assert len(names) == 21 - 6


# --- a pattern that matches nothing: exit 1, one line, in every command -------------


def _one_line_error(code: int, out: str, err: str, pattern: str) -> None:
    assert code == 1, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert pattern in lines[0] and "matches no" in lines[0], lines[0]


def test_inspect_no_match_is_an_error():
    code, out, err = _cli("inspect", LLAMA, "--filter", "model.layer.0.*")
    _one_line_error(code, out, err, "'model.layer.0.*'")
    # the line says how leaves are spelled, so the typo is easy to see
    assert "'model/embed_tokens/weight'" in err and "'model.embed_tokens.weight'" in err


def test_inspect_json_no_match_is_an_error():
    code, out, err = _cli("inspect", ORBAX, "--json", "--filter", "parms/**")
    _one_line_error(code, out, err, "'parms/**'")
    assert json.loads(out)["error"]["code"] == "no-match"  # --json: the error on stdout too


def test_diff_no_match_is_an_error():
    code, out, err = _cli("diff", LLAMA, LLAMA, "--filter", "model.layer.0.*")
    _one_line_error(code, out, err, "'model.layer.0.*'")
    assert "same" not in out


def test_diff_pattern_matching_one_side_only_is_a_difference(tmp_path):
    # not "no match": leaves on one side only are what diff reports
    code, out, err = _cli("diff", ORBAX, LLAMA, "--filter", "model.layers.0.*", "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert {d["kind"] for d in doc["differences"]} == {"only_b"} and len(doc["differences"]) == 9


def test_convert_select_no_match_is_an_error(tmp_path):
    dst = tmp_path / "out"
    # one good pattern and one typo: the typo is named, nothing is written
    code, out, err = _cli("convert", LLAMA, dst, "--to", "dcp", "--select", "model/layers/0/**", "--select", "model/layrs/1/**")
    _one_line_error(code, out, err, "'model/layrs/1/**'")
    assert "--select" in err
    assert not dst.exists()


def test_convert_exclude_no_match_is_an_error(tmp_path):
    dst = tmp_path / "out"
    code, out, err = _cli("convert", ORBAX, dst, "--to", "dcp", "--exclude", "opt_state/**")
    _one_line_error(code, out, err, "'opt_state/**'")
    assert "--exclude" in err
    assert not dst.exists()


def test_reshard_select_and_exclude(tmp_path):
    dst = tmp_path / "out"
    code, _, err = _cli("reshard", ORBAX, dst, "--mesh", "data=2", "--devices", "2",
                        "--select", "params.*", "--exclude", "params/embed/**")
    assert code == 0, err
    paths = sorted(leaf.path for leaf in ckpt_tool.open(str(dst)).leaves)
    src = ckpt_tool.open(str(ORBAX))
    assert paths == sorted(l.path for l in src.leaves if l.path.startswith("params/") and "embed" not in l.path)


def test_reshard_no_match_is_an_error(tmp_path):
    dst = tmp_path / "out"
    code, out, err = _cli("reshard", ORBAX, dst, "--mesh", "data=2", "--devices", "2", "--select", "parms/**")
    _one_line_error(code, out, err, "'parms/**'")
    assert not dst.exists()
    code, out, err = _cli("reshard", ORBAX, dst, "--mesh", "data=2", "--devices", "2", "--dry-run",
                          "--exclude", "opt_state/**")
    _one_line_error(code, out, err, "'opt_state/**'")
