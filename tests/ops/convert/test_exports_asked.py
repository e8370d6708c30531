"""Exports and diffs that do what was asked (issue 45, items 6, 7 and 8).

- 6: `convert --like HF_DIR --dtype bfloat16` checks names and shapes against the reference, and each
  dtype against the reference's tensor cast by the --dtype rule (not its float32): it passes, and the
  export loads with transformers' from_pretrained in bfloat16.
- 7: optimizer state saved by `torch.save(opt.state_dict())` (keyed by integer ids) and by DCP's
  `get_state_dict` (keyed by FQNs) is paired through param_groups in `diff`, and `convert
  --optimizer-keys-like CKPT` re-keys one into the other so that torch loads it; param groups that
  differ in count or size are one line naming both sides.
- 8: a diff that finds only floating dtype changes says so in one line, pointing to --cast-ok.

Every input is written by torch, DCP, transformers and safetensors themselves; the outputs are loaded
back with them.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from ckpt_tool.cli.main import _run  # noqa: E402

from conftest import FIXTURES  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
BIN_SET = FIXTURES / "torch_hf_bin_sharded"  # transformers .bin shards, tied embeddings stored twice
LLAMA = FIXTURES / "safetensors_llama_sharded"


def cli(*args: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _run([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


# -- item 6: --like with an explicit --dtype -----------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers' save_pretrained (float32 safetensors; tied: no lm_head)."""
    sys.path.insert(0, str(FIXTURES))
    from gen_torch_save import llama_model

    d = tmp_path_factory.mktemp("ref") / "llama"
    llama_model().save_pretrained(d)
    return d


def test_like_with_dtype_passes_and_loads_in_the_cast_dtype(reference: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bf16"
    code, stdout, err = cli("convert", BIN_SET, out, "--to", "safetensors", "--like", reference,
                            "--dtype", "bfloat16", "--json")
    assert code == 0, stdout + err
    doc = json.loads(stdout)
    assert doc["like_differences"] == [] and len(doc["cast"]) == 20
    assert [s["leaf"] for s in doc["skipped"]] == ["lm_head.weight"]
    model = AutoModelForCausalLM.from_pretrained(out)
    source = {}
    for f in sorted(BIN_SET.glob("*.bin")):
        source.update(torch.load(f, weights_only=True))
    for name, value in model.state_dict().items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(value, source[name].to(torch.bfloat16)), name


def test_like_with_dtype_still_checks_names_shapes_and_the_cast(reference: Path, tmp_path: Path) -> None:
    # a wrong --rename: the two name lines, and no dtype line for the 19 tensors the cast makes bfloat16
    code, stdout, err = cli("convert", BIN_SET, tmp_path / "out", "--to", "safetensors", "--like", reference,
                            "--rename", r"model/norm/=model/final_norm/", "--dtype", "bfloat16")
    assert code == 1
    assert [line.strip() for line in stdout.splitlines()] == [
        "model.final_norm.weight: in the output, not in the reference",
        "model.norm.weight: in the reference, not in the output",
    ]
    assert "(and 1 more: listed above)" in err and not (tmp_path / "out").exists()
    # a tensor the cast does not make what the reference's becomes: an integer one where the
    # reference holds float32 (its bfloat16 after the cast), and one of another shape
    from safetensors.torch import load_file

    tensors = load_file(reference / "model.safetensors")
    tensors["model.norm.weight"] = torch.arange(16, dtype=torch.int64)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(4, 4)
    torch.save(tensors, tmp_path / "edited.pt")
    code, stdout, err = cli("convert", tmp_path / "edited.pt", tmp_path / "out", "--to", "safetensors",
                            "--like", reference, "--dtype", "bfloat16")
    assert code == 1
    assert sorted(line.strip() for line in stdout.splitlines()) == [
        "model.layers.0.mlp.up_proj.weight: shape [4, 4], the reference has [32, 16]",
        "model.norm.weight: dtype int64, the reference's float32 is bfloat16 after --dtype bfloat16",
    ]
    # without --dtype the reference's dtypes are the rule, as before
    code, stdout, _ = cli("convert", tmp_path / "edited.pt", tmp_path / "out", "--to", "safetensors",
                          "--like", reference)
    assert code == 1 and "model.norm.weight: dtype int64, the reference has float32 (--dtype casts)" in stdout


# -- item 7: optimizer state keyed by ids and by FQNs --------------------------------------------


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


# the optimizer cases: each model's Adam param groups, as (layer of the Sequential, the group's own
# options); None: one group of model.parameters()
TWO_GROUPS = [(0, {}), (2, {"lr": 1e-2})]
SWAPPED = [(2, {"lr": 1e-2}), (0, {})]  # the same two groups listed the other way round (equal sizes)


def _adam(groups: list[tuple[int, dict]] | None = None, lr: float = 1e-3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """_model() and its Adam over `groups`, after one _step (with state to save or load into)."""
    model = _model()
    params = model.parameters() if groups is None else [
        {"params": [model[i].weight, model[i].bias], **options} for i, options in groups]
    opt = torch.optim.Adam(params, lr=lr)
    _step(model, opt)
    return model, opt


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One model and its Adam state after a step, saved by torch.save (state keyed by ids) and by DCP
    from get_state_dict (keyed by FQNs); and a DCP save of the same model with two param groups."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    d = tmp_path_factory.mktemp("optim")
    out = {"ids": d / "ids.pt", "fqns": d / "fqns", "two_groups": d / "two_groups",
           "two_groups_ids": d / "two_groups_ids.pt", "two_groups_swapped": d / "two_groups_swapped"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (single process: "assuming the intent is to save in a single process")
        for groups, by_ids, by_fqns in ((None, "ids", "fqns"), (TWO_GROUPS, "two_groups_ids", "two_groups"),
                                        (SWAPPED, None, "two_groups_swapped")):
            model, opt = _adam(groups)
            if by_ids:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out[by_ids])
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=out[by_fqns])
    return out


def test_diff_pairs_ids_and_fqns_through_param_groups(saves: dict[str, Path]) -> None:
    code, stdout, _ = cli("diff", saves["ids"], saves["fqns"], "--values")
    assert code == 0, stdout
    lines = stdout.splitlines()
    assert ("optim    paired 12 optimizer state leaves through optim/param_groups: keyed by ids in A, by FQNs "
            "in B (optim/state/0 in A is optim/state/0.weight in B)") in lines
    assert lines[-1] == "same: 32 leaves and values match"
    # either side may be the one keyed by ids
    code, stdout, _ = cli("diff", saves["fqns"], saves["ids"], "--values", "--json")
    assert code == 0
    doc = json.loads(stdout)
    assert doc["same"] and doc["optimizer_keys"] == [{
        "where": "optim/param_groups", "a": "FQNs", "b": "ids", "paired": 12,
        "example": ["optim/state/0.weight", "optim/state/0"], "note": None,
    }]
    # a real difference in the state is still found, under the FQN
    state = torch.load(saves["ids"], weights_only=True)
    state["optim"]["state"][2]["exp_avg"][0, 0] += 1
    torch.save(state, saves["ids"].with_name("changed.pt"))
    code, stdout, _ = cli("diff", saves["ids"].with_name("changed.pt"), saves["fqns"], "--values")
    assert code == 1
    assert [line.split(":")[0] for line in stdout.splitlines() if line.startswith("values")] == [
        "values   optim/state/2.weight/exp_avg"]


def test_diff_names_param_groups_that_differ_and_pairs_nothing(saves: dict[str, Path]) -> None:
    code, stdout, _ = cli("diff", saves["ids"], saves["two_groups"])
    assert code == 1
    optim = [line for line in stdout.splitlines() if line.startswith("optim")]
    assert optim == [
        "optim    optim/param_groups: the param groups differ in count (A keys its state by ids, 1 param group "
        "of 4 params; B keys its state by FQNs, 2 param groups of 2 + 2 params): not paired"]
    assert "only_a   optim/state/0/exp_avg: only in A" in stdout  # nothing guessed


def test_param_groups_listed_in_another_order_are_not_paired(saves: dict[str, Path], tmp_path: Path) -> None:
    # the same two groups in the same order pair (two groups of 2 + 2 params)
    code, stdout, _ = cli("diff", saves["two_groups_ids"], saves["two_groups"], "--values")
    assert code == 0, stdout
    assert "paired 12 optimizer state leaves" in stdout
    # listed the other way round: sizes agree, but position k holds a param of another shape
    code, stdout, _ = cli("diff", saves["two_groups_ids"], saves["two_groups_swapped"])
    assert code == 1
    optim = [line for line in stdout.splitlines() if line.startswith("optim")]
    assert optim == [
        "optim    optim/param_groups: the param groups list their params in another order: paired by position, "
        "optim/state/0/exp_avg in A is [8, 4] and optim/state/2.weight/exp_avg in B is [2, 8]; not paired"]
    code, stdout, err = cli("convert", saves["two_groups_ids"], tmp_path / "out", "--to", "dcp",
                            "--optimizer-keys-like", saves["two_groups_swapped"])
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "the param groups list their params in another order" in err and not (tmp_path / "out").exists()


def test_convert_rekeys_ids_to_fqns_and_dcp_loads_it(saves: dict[str, Path], tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = tmp_path / "fqns"
    code, stdout, err = cli("convert", saves["ids"], out, "--to", "dcp", "--optimizer-keys-like", saves["fqns"])
    assert code == 0, stdout + err
    assert stdout.splitlines()[0] == ("re-keyed 12 optimizer state leaves from ids to FQNs through "
                                      "optim/param_groups, as the reference keys them")
    # what get_state_dict of a fresh model and optimizer asks for is there: dcp.load fills it
    model = _model(seed=5)
    opt = torch.optim.Adam(model.parameters(), lr=5.0)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=out)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = torch.load(saves["ids"], weights_only=True)
    got = opt.state_dict()
    assert got["param_groups"] == saved["optim"]["param_groups"]
    assert sorted(got["state"]) == sorted(saved["optim"]["state"]) == [0, 1, 2, 3]
    for pid, entry in saved["optim"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)
    for name, value in saved["model"].items():
        assert torch.equal(model.state_dict()[name], value), name
    # and ckpt sees the two as one
    code, stdout, _ = cli("diff", out, saves["fqns"], "--values")
    assert code == 0, stdout


def test_convert_rekeys_fqns_to_ids_and_the_optimizer_loads_it(saves: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "ids"
    code, stdout, err = cli("convert", saves["fqns"], out, "--to", "dcp", "--optimizer-keys-like", saves["ids"],
                            "--json")
    assert code == 0, stdout + err
    assert json.loads(stdout)["optimizer_keys"] == [
        {"where": "optim/param_groups", "was": "FQNs", "now": "ids", "leaves": 12}]
    # the state dicts Module.state_dict() and Optimizer.state_dict() give (after a step, so that the
    # optimizer has state to load into): dcp.load fills them by the integer ids
    model, opt = _adam(lr=5.0)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=out)
    opt.load_state_dict(state["optim"])
    saved = torch.load(saves["ids"], weights_only=True)["optim"]
    assert opt.state_dict()["param_groups"] == saved["param_groups"]
    for pid, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(opt.state_dict()["state"][pid][name], value), (pid, name)


def test_convert_refuses_groups_that_differ(saves: dict[str, Path], tmp_path: Path) -> None:
    code, stdout, err = cli("convert", saves["ids"], tmp_path / "out", "--to", "dcp",
                            "--optimizer-keys-like", saves["two_groups"])
    assert code == 1 and stdout == ""
    [line] = err.strip().splitlines()
    assert "--optimizer-keys-like: optim/param_groups in the source, optim/param_groups in the reference: " \
           "the param groups differ in count (the source keys its state by ids, 1 param group of 4 params; " \
           "the reference keys its state by FQNs, 2 param groups of 2 + 2 params): not paired" in line
    assert not (tmp_path / "out").exists()
    # a reference without optimizer state: one line too
    code, _, err = cli("convert", saves["ids"], tmp_path / "out", "--to", "dcp", "--optimizer-keys-like", LLAMA)
    assert code == 1 and "the reference holds no optimizer state" in err and len(err.strip().splitlines()) == 1


# -- item 8: a diff of only dtype changes says so ------------------------------------------------


def test_a_diff_of_only_casts_says_so_in_one_line(tmp_path: Path) -> None:
    cast = tmp_path / "bf16"
    code, _, err = cli("convert", LLAMA, cast, "--to", "safetensors", "--dtype", "bfloat16")
    assert code == 0, err
    code, stdout, _ = cli("diff", LLAMA, cast)
    assert code == 1
    hints = [line for line in stdout.splitlines() if line.startswith("cast?")]
    assert hints == ["cast?    only dtypes differ (21 floating leaves float32 in A, bfloat16 in B), as after "
                     "convert --dtype: --cast-ok accepts the cast, and with --values --atol/--rtol compares the values"]
    assert stdout.splitlines()[-1] == "different: 21 differences in 21 common leaves"
    code, stdout, _ = cli("diff", LLAMA, cast, "--json")
    assert [(c["a"], c["b"], c["leaves"]) for c in json.loads(stdout)["only_casts"]] == [("float32", "bfloat16", 21)]
    # what the line points to accepts it
    code, stdout, _ = cli("diff", LLAMA, cast, "--cast-ok", "--values", "--rtol", "0.004")
    assert code == 0 and "cast?" not in stdout
    # anything else differing too: no such line (it would hide the other difference's cause)
    code, stdout, _ = cli("diff", LLAMA, cast, "--rename", "^model/norm/=model/final_norm/")
    assert code == 1 and "cast?" not in stdout and "only_a   model/final_norm/weight: only in A" in stdout
