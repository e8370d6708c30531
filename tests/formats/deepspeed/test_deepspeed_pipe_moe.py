"""DeepSpeed pipeline-parallel and MoE checkpoints (fixtures/gen_deepspeed_pipe_moe.py, DeepSpeed 0.19
on 2 and 4 gloo ranks): what is specific to these layouts beside the conformance suite (which
compares every leaf with DeepSpeed's recorded per-parameter views, validates, converts, damages).

Here: the names (PipelineModule's `<layer>.<name>` and `tied_modules.<key>.<name>`; MoE experts
renumbered globally as DeepSpeed's expert files name them), where each parameter's elements come
from (a stage's parameters from that stage's files; an expert's from the ranks of its
expert-parallel rank) against DeepSpeed's own param_slice_mappings, the tied weight's copies on
both stages, the experts' module weights in the expert files against their fp32 master weights,
convert to safetensors against the recorded values, validate's findings for a missing layer /
expert / stage file and a bit flipped in a file no leaf reads (--deep), what zero_to_fp32 says
of these layouts (recorded), and that inspect and validate import neither torch nor DeepSpeed.
Runs without DeepSpeed (the references are recorded in each fixture's _reference.json).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES
from test_deepspeed import assert_read_without_torch_or_deepspeed, recorded, reference

PIPE = ["deepspeed_pp2_z1", "deepspeed_pp2_dp2_z1"]
MOE = ["deepspeed_moe_ep1_z2", "deepspeed_moe_ep2_z2"]
EXPERT = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..*)$")


def storage(path: Path):  # noqa: ANN201
    from ckpt_tool.storage import Storage

    return Storage.open(str(path))


# --------------------------------------------------------------------------------------------
# names and values
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PIPE + MOE)
def test_every_tensor_is_deepspeeds_own_view(name):
    """The model leaves are the module's buffers and trained parameters by DeepSpeed's names, each
    the fp32 master weights DeepSpeed's safe_get_full_fp32_param gathered; the Adam moments are
    its safe_get_full_optimizer_state's: value for value, nothing more, nothing less."""
    import ckpt_tool

    ref = reference(name)
    want = {t["name"]: recorded(t) for t in ref["consolidated"]}
    for pname, states in ref["optimizer"].items():
        want.update({f"optimizer.state.{pname}.{k}": recorded(t) for k, t in states.items()})
    ck = ckpt_tool.open(str(FIXTURES / name))
    ours = {leaf.name: leaf for leaf in ck.leaves if leaf.kind == "array"}
    assert sorted(ours) == sorted(want)
    for n, v in want.items():
        got = ours[n].read()
        assert got.dtype == v.dtype and np.array_equal(got, v), n
    # the module's own names: every trained parameter DeepSpeed's module has (its state_dict)
    assert set(ref["fp32_params"]) <= set(ref["module"]) and set(ref["fp32_params"]) <= set(ours)


@pytest.mark.parametrize("name", PIPE)
def test_pipeline_names_are_the_pipeline_modules(name):
    """PipelineModule registers layer i under str(i) and a tied module under tied_modules.<key>: the
    tree's names; each layer file's keys, prefixed with the layer index, are the module's names
    (a TiedLayerSpec's file, layer 00 here, holds the tied module's weights under its own keys)."""
    import ckpt_tool

    ref = reference(name)
    ck = ckpt_tool.open(str(FIXTURES / name))
    model = [leaf.name for leaf in ck.leaves if leaf.keys[0] not in ("optimizer", "engine")]
    assert set(model) == set(ref["module"])  # buffers + every trained parameter (none frozen here)
    assert "tied_modules.embed.weight" in model and "2.scale" in model and "1.up.weight" in model
    assert ck.layout["pp"] == 2 and "2 pipeline stages" in ckpt_tool.formats.layout_text(ck)
    from ckpt_tool.formats.torch_save import reader as ts

    step = FIXTURES / name / "global_step2"
    for f in sorted(step.glob("layer_*-model_states.pt")):
        index = int(f.name[len("layer_"):].split("-")[0])
        keys = list(ts.Archive(storage(step), f.name).obj)
        if index == 0:
            assert keys == ["weight"]  # the tied embedding
            assert any("TiedLayerSpec" in n and f.name in n for n in ck.notes)
        else:
            assert {f"{index}.{k}" for k in keys} <= set(ref["module"]), f.name


@pytest.mark.parametrize("name", PIPE)
def test_each_stage_reads_its_own_partitions(name):
    """Stage s's parameters come from zero_pp_rank_*_mp_rank_0s files only, at exactly the
    {start, numel} DeepSpeed recorded for them (param_slice_mappings) in each rank's partition."""
    from ckpt_tool.formats.deepspeed import pipeline
    from ckpt_tool.formats.deepspeed import reader as ds

    st = storage(FIXTURES / name / "global_step2")
    stages = pipeline.open_stages(st, ds.scan_step(st))
    assert len(stages) == 2
    dp = reference(name)["facts"]["world_size"] // 2
    for stage in stages:
        step = stage.step
        assert step.world == dp and not step.mapping.problems and step.files.mp == stage.index
        ours = {(p.rank, n, p.start, p.count) for n, pieces in step.mapping.pieces.items() for p in pieces}
        theirs = set()
        for rank, o in step.optims.items():
            assert o.archive.name == f"zero_pp_rank_{rank}_mp_rank_{stage.index:02d}_optim_states.pt"
            for group in o.archive.obj["optimizer_state_dict"]["param_slice_mappings"]:
                theirs |= {(rank, n, a.start, a.numel) for n, a in group.items()}
        assert ours == theirs
        names = set(step.mapping.pieces)
        assert "tied_modules.embed.weight" in names  # each stage trains its copy
        assert all(n.startswith("tied_modules.") or int(n.split(".")[0]) in ((1, 2) if stage.index == 0 else (3, 4))
                   for n in names)


@pytest.mark.parametrize("name", PIPE)
def test_the_tied_weights_copies_agree(name):
    """Both stages keep (and train) a copy of the tied embedding; DeepSpeed all-reduces their
    gradients, so the copies are equal; stage 0's is given (a note says so), and its layer file
    (the module weights, fp32 training) holds the same values."""
    import ckpt_tool
    from ckpt_tool.formats.deepspeed import pipeline
    from ckpt_tool.formats.deepspeed import reader as ds
    from ckpt_tool.formats.torch_save import reader as ts

    st = storage(FIXTURES / name / "global_step2")
    stages = pipeline.open_stages(st, ds.scan_step(st))
    copies = []
    for stage in stages:
        leaves, _ = ds.step_leaves(stage.step)
        copies.append(next(leaf for leaf in leaves if leaf.name == "tied_modules.embed.weight").read())
    assert np.array_equal(copies[0], copies[1])
    ck = ckpt_tool.open(str(FIXTURES / name))
    assert any("tied_modules.embed.weight is trained on stages 0, 1" in n for n in ck.notes)
    layer0 = next(f for f in ds.scan_step(st).layers.values() if f.startswith("layer_00"))
    archive = ts.Archive(st, layer0)
    module = ts.TensorReader(archive, archive.obj["weight"], "weight")(tuple(slice(0, d) for d in copies[0].shape))
    assert np.array_equal(module, copies[0])


@pytest.mark.parametrize("name", MOE)
def test_experts_are_parameters_of_their_own_from_their_ranks(name):
    """Every expert of the MoE layer by its global number; with ep_size 2 the experts 0-1 come from
    rank 0's files and 2-3 from rank 1's (each rank's expert group holds its own experts whole, the
    names renumbered as DeepSpeed's _save_moe_checkpoint does); with ep_size 1 the expert group is
    partitioned over both ranks like any group. Against param_slice_mappings, which each rank records
    by LOCAL expert number."""
    import ckpt_tool
    from ckpt_tool.formats.deepspeed import reader as ds

    ep = reference(name)["facts"]["ep_size"]
    step = ds.open_step(storage(FIXTURES / name / "global_step2"))
    assert not step.mapping.problems
    experts = {n for n in step.mapping.pieces if EXPERT.match(n)}
    assert {int(EXPERT.match(n).group(2)) for n in experts} == {0, 1, 2, 3}
    ours = {(p.rank, n, p.start, p.count) for n, pieces in step.mapping.pieces.items() for p in pieces}
    theirs = set()
    for rank, o in step.optims.items():
        for group in o.archive.obj["optimizer_state_dict"]["param_slice_mappings"]:
            for n, a in group.items():
                m = EXPERT.match(n)
                if m and ep > 1:  # local -> global: ep_rank x num_local + local (ep_rank = rank mod ep)
                    n = f"{m.group(1)}{(rank % ep) * (4 // ep) + int(m.group(2))}{m.group(3)}"
                theirs.add((rank, n, a.start, a.numel))
    assert ours == theirs
    if ep == 2:
        for n in experts:
            assert {p.rank for p in step.mapping.pieces[n]} == {int(EXPERT.match(n).group(2)) // 2}
    ck = ckpt_tool.open(str(FIXTURES / name))
    assert ck.layout["experts"] == 4 and "4 MoE experts" in ckpt_tool.formats.layout_text(ck)


@pytest.mark.parametrize("name", MOE)
def test_expert_files_hold_each_experts_module_weights(name):
    """layer_0_expert_E_...: expert E's module weights by their full global names; fp32 training,
    so they are the fp32 master weights ckpt assembles from the partitions."""
    import ckpt_tool
    from ckpt_tool.formats.deepspeed import reader as ds
    from ckpt_tool.formats.torch_save import reader as ts

    st = storage(FIXTURES / name / "global_step2")
    files = ds.scan_step(st)
    assert sorted(files.experts) == [(0, e) for e in range(4)]
    ck = ckpt_tool.open(str(FIXTURES / name))
    for (_, expert), fname in files.experts.items():
        archive = ts.Archive(st, fname)
        assert archive.obj and all(int(EXPERT.match(k).group(2)) == expert for k in archive.obj)
        for key, ref in archive.obj.items():
            value = ts.TensorReader(archive, ref, key)(tuple(slice(0, d) for d in ref.size))
            assert np.array_equal(value, ck[key].read()), key


def test_zero_to_fp32_reads_none_of_these_layouts():
    """Recorded by the generator: DeepSpeed's zero_to_fp32 fails on a pipeline checkpoint (its
    model-states files hold no module) and on an MoE one (it takes the expert files for rank model
    states): why the reference is DeepSpeed's per-parameter gathering instead."""
    for name in PIPE:
        assert "NoneType" in reference(name)["zero_to_fp32"]["error"]
    for name in MOE:
        assert "is not a model state checkpoint" in reference(name)["zero_to_fp32"]["error"]


def test_convert_to_safetensors_gives_the_recorded_values(tmp_path, ckpt):
    from safetensors.numpy import load_file

    for name in ("deepspeed_pp2_dp2_z1", "deepspeed_moe_ep2_z2"):
        out = tmp_path / name
        r = ckpt("convert", FIXTURES / name, out, "--to", "safetensors", "--exclude", "optimizer/**",
                 "--exclude", "engine/**")
        assert r.returncode == 0, r.stderr
        got: dict = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(load_file(str(f)))
        want = {t["name"]: recorded(t) for t in reference(name)["consolidated"]}
        assert sorted(got) == sorted(want)
        assert all(np.array_equal(got[n], v) and got[n].dtype == v.dtype for n, v in want.items())


def test_universal_output_is_refused_for_these_layouts(tmp_path, ckpt):
    for name in ("deepspeed_pp2_z1", "deepspeed_moe_ep2_z2"):
        r = ckpt("convert", FIXTURES / name, tmp_path / name, "--to", "deepspeed-universal")
        assert r.returncode == 1 and "pipeline-parallel or MoE" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / name).exists()


# --------------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------------

def _damaged(tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(FIXTURES / name, copy)
    return copy


def _errors(ckpt, path: Path, *extra: str) -> list[dict]:  # noqa: ANN001
    r = ckpt("validate", "--json", "--strict", *extra, path)
    assert r.returncode == 1, r.stdout
    return [f for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"]


def test_a_missing_layer_file(tmp_path, ckpt):
    copy = _damaged(tmp_path, "deepspeed_pp2_z1")
    (copy / "global_step2" / "layer_02-model_states.pt").unlink()
    [f] = _errors(ckpt, copy)
    assert (f["code"], f["file"]) == ("missing-file", "global_step2/layer_02-model_states.pt")
    assert "layer 2's module state" in f["message"] and "2.scale" in f["message"]
    doc = json.loads(ckpt("inspect", "--json", copy).stdout)
    assert doc["status"] == "incomplete" and doc["missing"][0]["leaves"] == ["2.scale"]


def test_a_missing_stage_optimizer_file(tmp_path, ckpt):
    """A stage's only optimizer-states file (DP 1): its parameters are named, not left out."""
    copy = _damaged(tmp_path, "deepspeed_pp2_z1")
    gone = "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    (copy / "global_step2" / gone).unlink()
    [f] = _errors(ckpt, copy)
    assert (f["code"], f["file"]) == ("missing-file", f"global_step2/{gone}") and "pipeline stage 1" in f["message"]
    doc = json.loads(ckpt("inspect", "--json", copy).stdout)
    assert doc["status"] == "incomplete"
    [missing] = doc["missing"]
    assert "3.up.weight" in missing["leaves"] and "4.bias" in missing["leaves"]
    r = ckpt("convert", copy, tmp_path / "out", "--to", "safetensors", "--skip-unsupported")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_missing_rank_file_of_a_stage(tmp_path, ckpt):
    copy = _damaged(tmp_path, "deepspeed_pp2_dp2_z1")
    gone = "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    (copy / "global_step2" / gone).unlink()
    [f] = _errors(ckpt, copy)
    assert (f["code"], f["file"]) == ("missing-file", f"global_step2/{gone}")
    assert "degree is 2 (pipeline stage 1)" in f["message"]


def test_a_missing_stage_model_states_file(tmp_path, ckpt):
    copy = _damaged(tmp_path, "deepspeed_pp2_z1")
    (copy / "global_step2" / "mp_rank_01_model_states.pt").unlink()
    [f] = _errors(ckpt, copy)
    assert (f["code"], f["file"]) == ("missing-file", "global_step2/mp_rank_01_model_states.pt")
    r = ckpt("inspect", copy)
    assert r.returncode == 1 and "pipeline stage 1" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_missing_expert_file(tmp_path, ckpt):
    copy = _damaged(tmp_path, "deepspeed_moe_ep2_z2")
    gone = "layer_0_expert_3_mp_rank_00_model_states.pt"
    (copy / "global_step2" / gone).unlink()
    [f] = _errors(ckpt, copy)
    assert (f["code"], f["file"]) == ("missing-file", f"global_step2/{gone}")
    assert "expert 3 of MoE layer 0" in f["message"]
    assert json.loads(ckpt("inspect", "--json", copy).stdout)["status"] == "incomplete"


def test_an_expert_file_holding_another_expert(tmp_path, ckpt):
    copy = _damaged(tmp_path, "deepspeed_moe_ep1_z2")
    step = copy / "global_step2"
    shutil.copyfile(step / "layer_0_expert_1_mp_rank_00_model_states.pt", step / "layer_0_expert_2_mp_rank_00_model_states.pt")
    errors = _errors(ckpt, copy)
    assert errors and all(f["code"] == "bad-metadata" and f["file"].endswith("expert_2_mp_rank_00_model_states.pt")
                          and "not a parameter of expert 2" in f["message"] for f in errors)


def test_deep_checks_the_files_no_leaf_reads(tmp_path, ckpt):
    """layer_00 (the tied module's weights) is read by no leaf: shallow validate passes, --deep
    streams its storages and finds the flipped bit."""
    import zipfile

    copy = _damaged(tmp_path, "deepspeed_pp2_z1")
    target = copy / "global_step2" / "layer_00-model_states.pt"
    with zipfile.ZipFile(target) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size)
    data = bytearray(target.read_bytes())
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26: info.header_offset + 28], "little"), \
        int.from_bytes(data[info.header_offset + 28: info.header_offset + 30], "little")
    data[info.header_offset + 30 + name_len + extra_len + 5] ^= 0x10
    target.write_bytes(bytes(data))
    assert ckpt("validate", "--strict", copy).returncode == 0
    [f] = _errors(ckpt, copy, "--deep")
    assert (f["code"], f["file"]) == ("bad-chunk", "global_step2/layer_00-model_states.pt")


def test_tensor_parallel_layer_files_and_expp_files_are_refused_by_name(tmp_path, ckpt):
    copy = _damaged(tmp_path, "deepspeed_pp2_z1")
    step = copy / "global_step2"
    shutil.copyfile(step / "layer_01-model_states.pt", step / "layer_01-model_01-model_states.pt")
    r = ckpt("inspect", copy)
    assert r.returncode == 1 and "tensor parallelism" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    copy = _damaged(tmp_path / "b", "deepspeed_moe_ep1_z2")
    shutil.copyfile(copy / "global_step2" / "mp_rank_00_model_states.pt",
                    copy / "global_step2" / "expp_rank_0_mp_rank_00_optim_states.pt")
    r = ckpt("inspect", copy)
    assert r.returncode == 1 and "without ZeRO" in r.stderr


def test_inspect_and_validate_import_neither_torch_nor_deepspeed():
    assert_read_without_torch_or_deepspeed(FIXTURES / "deepspeed_pp2_dp2_z1", FIXTURES / "deepspeed_moe_ep2_z2")


@pytest.mark.parametrize("name", PIPE + MOE)
def test_weights_module_gives_the_modules_state_dict(name, tmp_path, ckpt):
    """--weights module: the model part is what DeepSpeed's module state_dict held in the run (every
    rank's, by its names): for a pipeline the layer files (a tied module's file under
    tied_modules.<key>), for MoE mp_rank_00's module plus the expert files; the optimizer and engine
    parts are unchanged. fp32 training: the same values as the fp32 master weights."""
    import ckpt_tool
    from ckpt_tool import formats

    ref = reference(name)
    with formats.read_options(weights="module"):
        ck = ckpt_tool.open(str(FIXTURES / name))
    model = {leaf.name: leaf for leaf in ck.leaves if leaf.keys[0] not in ("optimizer", "engine")}
    assert sorted(model) == sorted(ref["module"])
    for n, t in ref["module"].items():
        assert np.array_equal(model[n].read(), recorded(t)), n
    fp32 = ckpt_tool.open(str(FIXTURES / name))
    assert [leaf.name for leaf in ck.leaves if leaf.keys[0] in ("optimizer", "engine")] == \
        [leaf.name for leaf in fp32.leaves if leaf.keys[0] in ("optimizer", "engine")]
    r = ckpt("validate", "--strict", "--deep", "--weights", "module", FIXTURES / name)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_layer_file_tensor_no_optimizer_holds_is_given_as_stored(tmp_path):
    """A parameter of a layer the optimizer does not hold (frozen: DeepSpeed keeps no fp32 copy of
    it, but the layer file has its module weights): given under its module name as stored, with a
    note. The layer file is re-saved by torch with one more entry (IMITATED: what save_state_dict
    writes for a layer with a frozen parameter)."""
    import torch

    import ckpt_tool

    copy = _damaged(tmp_path, "deepspeed_pp2_z1")
    target = copy / "global_step2" / "layer_03-model_states.pt"
    state = torch.load(target, weights_only=True)
    state["gate"] = torch.linspace(-1, 1, 5)
    torch.save(state, target)
    ck = ckpt_tool.open(str(copy))
    assert np.array_equal(ck["3.gate"].read(), np.linspace(-1, 1, 5, dtype=np.float32))
    assert any(n.startswith("3.gate: in layer_03-model_states.pt but held by no optimizer") for n in ck.notes)
    assert "optimizer.state.3.gate.exp_avg" not in [leaf.name for leaf in ck.leaves]


def test_layouts_not_read_yet_are_named(tmp_path, ckpt):
    """Pipeline stages with MoE expert files; an MoE run whose config swaps the expert-parallel and
    expert data-parallel ranks (use_data_before_expert_parallelism): one line each, naming it."""
    import torch

    copy = _damaged(tmp_path, "deepspeed_pp2_z1")
    shutil.copyfile(FIXTURES / "deepspeed_moe_ep1_z2" / "global_step2" / "layer_0_expert_0_mp_rank_00_model_states.pt",
                    copy / "global_step2" / "layer_0_expert_0_mp_rank_00_model_states.pt")
    r = ckpt("inspect", copy)
    assert r.returncode == 1 and "pipeline-parallel checkpoint with MoE expert files" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    copy = _damaged(tmp_path / "b", "deepspeed_moe_ep2_z2")
    target = copy / "global_step2" / "mp_rank_00_model_states.pt"
    states = torch.load(target, weights_only=False)  # (DeepSpeed is not here: plain dicts and tensors)
    states["ds_config"]["use_data_before_expert_parallelism"] = True
    torch.save(states, target)
    r = ckpt("inspect", copy)
    assert r.returncode == 1 and "use_data_before_expert_parallelism" in r.stderr
