"""DeepSpeed ZeRO checkpoints: what is specific to the format beside the conformance suite
(tests/conformance/: inspect and values against DeepSpeed's recorded zero_to_fp32 output and
per-parameter optimizer state, validate, convert to every writer, damage, fuzz smoke).

Here: the partition layout against DeepSpeed's own record of it (param_slice_mappings), stage 3's
per-parameter partitioning against stages 1/2's flat groups, bf16 training (fp32 master weights,
buffers cast as zero_to_fp32 casts them, frozen parameters as stored), `--dtype bfloat16` export
against torch's cast of zero_to_fp32's output, `--select` / `--exclude` of the optimizer and engine
state, roots (`latest`, `--step`), what validate says of a missing rank file, of partitions that do
not match the recorded shapes and of a `latest` naming nothing, the layouts refused by name, that
inspect and validate import neither torch nor DeepSpeed, and a parameter larger than --memory
streamed in bands.

Checkpoints built here with torch (the big one, the damaged shapes) are IMITATED: laid out the way
DeepSpeed 0.19's `state_dict` methods write them (runtime/zero/stage_1_and_2.py, stage3.py, its
engine's model-states dict), without DeepSpeed's classes; DeepSpeed is not in the test venv.
test_the_imitation_lays_partitions_out_as_deepspeed checks them against the real fixtures.
"""
from __future__ import annotations

import base64
import json
import math
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, peak_rss_mib

ROOT = Path(__file__).resolve().parents[3]
REAL = ["deepspeed_z1_fp32", "deepspeed_z1_bf16", "deepspeed_z2_fp32", "deepspeed_z2_bf16", "deepspeed_z3_fp32",
        "deepspeed_z3_bf16"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run(*args: object) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=environ, timeout=300)


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "_reference.json").read_text())


def recorded(t: dict) -> np.ndarray:
    import ml_dtypes

    dt = np.dtype(getattr(ml_dtypes, t["dtype"], None) or t["dtype"])
    return np.frombuffer(base64.b64decode(t["data"]), dtype=dt).reshape(t["shape"])


def open_step(path: Path):  # noqa: ANN201
    from ckpt_tool.formats.deepspeed import reader as ds
    from ckpt_tool.storage import Storage

    return ds.open_step(Storage.open(str(path)))


# --------------------------------------------------------------------------------------------
# the layout, against DeepSpeed's own record of it
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in REAL if "_z3_" not in n])
def test_stage12_pieces_are_deepspeeds_param_slice_mappings(name):
    """Each optimizer-states file records, per parameter on that rank, {start, numel} in the rank's
    partition (param_slice_mappings: what DeepSpeed's universal-checkpoint code reads): every piece
    ckpt derives from the shapes, DP degree and paddings is exactly one of them, and vice versa."""
    step = open_step(FIXTURES / name / "global_step2")
    assert step.stage in (1, 2) and step.world == 2 and not step.mapping.problems
    ours = {(p.rank, name_, p.start, p.count) for name_, pieces in step.mapping.pieces.items() for p in pieces}
    theirs = set()
    for rank, o in step.optims.items():
        for group in o.archive.obj["optimizer_state_dict"]["param_slice_mappings"]:
            theirs |= {(rank, pname, addr.start, addr.numel) for pname, addr in group.items()}
    assert ours == theirs


def test_stage3_splits_every_parameter_over_every_rank_and_stage2_does_not():
    z3 = open_step(FIXTURES / "deepspeed_z3_fp32" / "global_step2")
    for pname, pieces in z3.mapping.pieces.items():
        numel = z3.mapping.numel[pname]
        part = math.ceil(numel / 2)
        assert [(p.rank, p.count, p.at) for p in pieces] == [(0, part, 0), (1, numel - part, part)], pname
    # each rank's flat groups hold its partitions back to back: group lengths are the sums
    per_group = [sum(math.ceil(math.prod(s) / 2) for _, s in group) for group in z3.shapes]
    assert [t.size[0] for t in z3.optims[0].flats] == per_group == [t.size[0] for t in z3.optims[1].flats]
    z2 = open_step(FIXTURES / "deepspeed_z2_fp32" / "global_step2")
    # stage 2: one flat vector per group, cut in two; the 480-element embedding is the head of group 0 (rank 0)
    assert [(p.rank, p.start, p.count) for p in z2.mapping.pieces["embed.weight"]] == [(0, 0, 480)]
    assert sum(len(p) == 2 for p in z2.mapping.pieces.values()) >= 1  # a parameter cut between the ranks
    lengths = [[t.size[0] for t in o.flats] for o in z2.optims.values()]
    paddings = [o.group_paddings for o in z2.optims.values()]
    # the last rank's partition of each group is shorter by the group's end padding (its view, not its storage)
    assert [lengths[0][g] == lengths[1][g] + paddings[1][g] for g in range(2)] == [True, True]
    assert z2.optims[1].flats[1].storage.numel == lengths[1][1] + paddings[1][1]


def test_layout_arithmetic_on_alignment_and_missing_elements():
    from ckpt_tool.formats.deepspeed import layout as L

    # 2 params of 3 and 4 elements, parameter alignment padding 1 after the first, 2 ranks: 8 elements
    # aligned to 4 -> P = 4; rank 1 stores 4 - 0 = 4 (no end padding left)
    m = L.zero12([[("a", 3), ("b", 4)]], [[4], [4]], [[0], [0]], [[1, 0]])
    assert not m.problems
    assert [(p.rank, p.start, p.count, p.at) for p in m.pieces["b"]] == [(1, 0, 4, 0)]
    # the shapes ask for more than the partitions hold: named, as zero_to_fp32's check would fail
    m = L.zero12([[("a", 3), ("b", 9)]], [[4], [4]], [[0], [0]], None)
    assert any("b needs elements" in p for p in m.problems) and any("take 12 elements" in p for p in m.problems)
    m = L.zero3([("a", 5), ("b", 2)], [[4], [4]])
    assert not m.problems and [(p.rank, p.start, p.count, p.at) for p in m.pieces["b"]] == [(0, 3, 1, 0), (1, 3, 1, 1)]
    assert L.zero3([("a", 5)], [[4], [4]]).problems  # 3 per rank taken, 4 stored


# --------------------------------------------------------------------------------------------
# bf16 training, the dtype of the export, --select / --exclude
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["deepspeed_z1_bf16", "deepspeed_z2_bf16", "deepspeed_z3_bf16"])
def test_bf16_training_gives_fp32_master_weights_and_zero_to_fp32s_dtypes(name):
    import ckpt_tool

    ck = ckpt_tool.open(str(FIXTURES / name))
    assert ck.layout["precision"] == "bf16" and "bf16 training" in ckpt_tool.formats.layout_text(ck)
    files = ck.layout["optimizer_files"]
    assert files and all(f.startswith("bf16_zero_pp_rank_") for f in files)
    want = {t["name"]: t["dtype"] for t in reference(name)["zero_to_fp32"]}
    assert {n: ck[n].dtype for n in want} == want
    assert want["embed.weight"] == "float32" and want["position_ids"] == "int64"
    if "layers.0.gate" in want:  # frozen (stages 2/3): as stored, bf16 (zero_to_fp32 does not cast it)
        assert want["layers.0.gate"] == "bfloat16"
    # DeepSpeed 0.19 keeps float buffers in float32 under bf16 (a 16-bit one: test_a_16_bit_buffer_...)
    assert open_step(FIXTURES / name / "global_step2").states["module"]["scale"].dtype == "float32"
    assert ck["scale"].dtype == "float32" and ck["scale"].read().dtype == np.float32


@pytest.mark.slow
def test_dtype_bfloat16_export_is_torchs_cast_of_zero_to_fp32(tmp_path):
    """zero_to_fp32's `convert_zero_checkpoint_to_state_dict(dtype=torch.bfloat16)` casts each floating
    tensor with `.to(torch.bfloat16)` and keeps integer buffers: the same values, read by safe_open."""
    import torch
    from safetensors import safe_open

    out = tmp_path / "bf16"
    r = run("convert", FIXTURES / "deepspeed_z3_fp32", out, "--to", "safetensors", "--exclude", "optimizer/**",
            "--exclude", "engine/**", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    ref = reference("deepspeed_z3_fp32")["zero_to_fp32"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(t["name"] for t in ref)
        for t in ref:
            want = torch.from_numpy(recorded(t).copy())
            if want.is_floating_point():
                want = want.to(torch.bfloat16)
            got = f.get_tensor(t["name"])
            assert got.dtype == want.dtype and torch.equal(got, want), t["name"]


def test_select_and_exclude_the_optimizer_and_engine_state(tmp_path, ckpt):
    ref = reference("deepspeed_z2_bf16")
    r = ckpt("convert", FIXTURES / "deepspeed_z2_bf16", tmp_path / "weights", "--to", "safetensors",
             "--exclude", "optimizer/**", "--exclude", "engine/**", "--json")
    assert r.returncode == 0, r.stderr
    got = ckpt("inspect", "--json", tmp_path / "weights").stdout
    assert sorted(leaf["name"] for leaf in json.loads(got)["leaves"]) == sorted(t["name"] for t in ref["zero_to_fp32"])
    r = ckpt("convert", FIXTURES / "deepspeed_z2_bf16", tmp_path / "moments", "--to", "dcp",
             "--select", "optimizer/state/*/exp_avg*")
    assert r.returncode == 0, r.stderr
    names = sorted(leaf["name"] for leaf in json.loads(ckpt("inspect", "--json", tmp_path / "moments").stdout)["leaves"])
    assert names == sorted(f"optimizer.state.{p}.{k}" for p in ref["optimizer"] for k in ("exp_avg", "exp_avg_sq"))


def test_optimizer_param_groups_name_their_parameters():
    import ckpt_tool

    ck = ckpt_tool.open(str(FIXTURES / "deepspeed_z3_bf16"))
    groups = ck["optimizer.param_groups"].load()
    assert [g["params"] for g in groups] == [g["params"] for g in reference("deepspeed_z3_bf16")["param_groups"]]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert ck["engine.lr_scheduler.last_batch_iteration"].load() == 1 and ck["engine.global_steps"].load() == 2


# --------------------------------------------------------------------------------------------
# roots and steps
# --------------------------------------------------------------------------------------------

def test_root_step_and_step_directory_read_the_same(tmp_path, ckpt):
    root = FIXTURES / "deepspeed_z2_fp32"
    docs = [json.loads(ckpt("inspect", "--json", *args).stdout)["leaves"]
            for args in ([root], [root, "--step", "2"], [root, "--step", "global_step2"], [root, "--step", "latest"],
                         [root / "global_step2"])]
    assert all(d == docs[0] for d in docs)
    r = ckpt("inspect", root, "--step", "3")
    # a step the root does not have: not-found (exit 1), the same line on every run root
    assert r.returncode == 1 and r.stderr == f"ckpt: error: {root}: --step 3: no such step (steps: 2 committed)\n"
    # a second step beside it, `latest` still naming the first: `latest` decides; --step picks the other
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    shutil.copytree(copy / "global_step2", copy / "global_step7")
    doc = json.loads(ckpt("inspect", "--json", copy).stdout)
    assert doc["step"] == 2 and [s["name"] for s in doc["steps"]] == ["global_step2", "global_step7"]
    assert json.loads(ckpt("inspect", "--json", copy, "--step", "7").stdout)["step"] == 7
    # without `latest`, the highest global_stepN (DeepSpeed's load_checkpoint would need a tag: a warning)
    (copy / "latest").unlink()
    assert json.loads(ckpt("inspect", "--json", copy).stdout)["step"] == 7
    r = ckpt("validate", "--json", copy)
    assert r.returncode == 0
    assert [(f["code"], f["severity"]) for f in json.loads(r.stdout)["findings"]] == [("missing-metadata", "warning")]


def test_latest_naming_a_missing_directory(tmp_path, ckpt):
    copy = tmp_path / "run"
    shutil.copytree(FIXTURES / "deepspeed_z1_fp32", copy)
    (copy / "latest").write_text("global_step9")
    r = ckpt("validate", "--json", copy)
    assert r.returncode == 1
    [finding] = json.loads(r.stdout)["findings"]
    assert (finding["code"], finding["file"]) == ("missing-file", "latest") and "global_step9" in finding["message"]
    r = ckpt("inspect", copy)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "latest names 'global_step9'" in r.stderr
    assert ckpt("inspect", copy, "--step", "2").returncode == 0  # the step that is there still reads


def test_a_missing_rank_file_makes_it_incomplete(tmp_path, ckpt):
    copy = tmp_path / "run"
    shutil.copytree(FIXTURES / "deepspeed_z3_bf16", copy)
    gone = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (copy / "global_step2" / gone).unlink()
    doc = json.loads(ckpt("inspect", "--json", copy).stdout)
    assert doc["status"] == "incomplete"
    [missing] = doc["missing"]
    assert missing["file"] == f"global_step2/{gone}"
    # at stage 3 every parameter has elements on rank 1: weights and moments are all named
    assert "embed.weight" in missing["leaves"] and "optimizer.state.mix.exp_avg" in missing["leaves"]
    r = ckpt("validate", "--json", copy)
    assert r.returncode == 1
    [finding] = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "missing-file"]
    assert finding["file"] == f"global_step2/{gone}" and "degree is 2" in finding["message"]
    r = ckpt("convert", copy, tmp_path / "out", "--to", "safetensors", "--skip-unsupported")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, what", [
    ("layer_01-model_01-model_states.pt", "pipeline-parallel"),  # (tensor parallel inside a pipeline)
    ("expp_rank_0_mp_rank_00_optim_states.pt", "MoE expert"),
    ("mp_rank_01_model_states.pt", "model-parallel ranks"),
])
def test_layouts_not_read_yet_are_refused_by_name(tmp_path, ckpt, extra, what):
    copy = tmp_path / "run"
    shutil.copytree(FIXTURES / "deepspeed_z2_fp32", copy)
    shutil.copyfile(copy / "global_step2" / "mp_rank_00_model_states.pt", copy / "global_step2" / extra)
    r = ckpt("inspect", copy)
    assert r.returncode == 1 and what in r.stderr and extra in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = ckpt("validate", "--json", copy)
    assert r.returncode == 1 and json.loads(r.stdout)["findings"][0]["code"] == "bad-metadata"


# --------------------------------------------------------------------------------------------
# imitated checkpoints (the layout of DeepSpeed's state_dict, written with torch)
# --------------------------------------------------------------------------------------------

def imitate(root: Path, stage: int, groups: list[OrderedDict], world: int = 2, *, tag: str = "global_step1",
            shapes: list[OrderedDict] | None = None, zero_stage: bool = True,
            buffers: OrderedDict | None = None) -> Path:
    """A ZeRO checkpoint laid out as DeepSpeed 0.19 writes it (see the module docstring), from
    `groups` (per optimizer group, name -> float32 tensor) and module `buffers`. `shapes` overrides
    the recorded param_shapes (to damage them); zero_stage=False leaves it out (BF16_Optimizer's)."""
    import torch

    step_dir = root / tag
    step_dir.mkdir(parents=True)
    (root / "latest").write_text(tag)
    gen = torch.Generator().manual_seed(0)
    buffers = buffers or OrderedDict()
    param_shapes = shapes or [OrderedDict((n, torch.Size(t.shape)) for n, t in g.items()) for g in groups]
    common = {"buffer_names": list(buffers), "optimizer": None, "param_shapes": param_shapes,
              "frozen_param_shapes": {} if stage >= 2 else None, "shared_params": {},
              "frozen_param_fragments": {} if stage >= 2 else None, "lr_scheduler": None, "data_sampler": None,
              "random_ltd": None, "skipped_steps": 0, "global_steps": 1, "global_samples": 2,
              "dp_world_size": world, "mp_world_size": 1, "ds_config": {"zero_optimization": {"stage": stage}},
              "ds_version": "0.19.8"}
    hyper = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

    def optim_file(rank: int, osd: dict) -> None:
        if not zero_stage:
            osd.pop("zero_stage")
        torch.save({"optimizer_state_dict": osd, "ds_config": common["ds_config"], "ds_version": "0.19.8"},
                   step_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")

    def moments(n: int) -> dict:
        return {"step": torch.tensor(1.0), "exp_avg": torch.randn(n, generator=gen),
                "exp_avg_sq": torch.rand(n, generator=gen)}

    if stage in (1, 2):
        module = OrderedDict((n, t) for g in groups for n, t in g.items())
        torch.save(dict(common, module=OrderedDict(**module, **buffers)), step_dir / "mp_rank_00_model_states.pt")
        flats, pads, states = [[] for _ in range(world)], [[] for _ in range(world)], [[] for _ in range(world)]
        for g in groups:
            flat = torch.cat([t.reshape(-1) for t in g.values()])
            align = 2 * world  # nccl_start_alignment_factor x DP
            padded = torch.zeros(math.ceil(flat.numel() / align) * align)
            padded[: flat.numel()] = flat
            part = padded.numel() // world
            for r in range(world):
                left = r * part  # stage_1_and_2.py: the padding a rank's partition holds past the data
                pad = part if flat.numel() <= left else max(0, left + part - flat.numel())
                mine = padded[left: left + part].clone()
                flats[r].append(mine[: part - pad])  # _get_groups_without_padding: a view of the clone
                pads[r].append(pad)
                states[r].append(moments(part))
        for r in range(world):
            optim_file(r, {"zero_stage": stage, "partition_count": [world] * len(groups), "overflow": False,
                           "base_optimizer_state": {"state": dict(enumerate(states[r])),
                                                    "param_groups": [dict(hyper, params=[i])
                                                                     for i in range(len(groups))]},
                           "single_partition_of_fp32_groups": flats[r], "group_paddings": pads[r],
                           "param_alignment_paddings": [[0] * len(g) for g in groups], "ds_version": "0.19.8"})
    else:
        for r in range(world):
            flats = []
            for g in groups:
                pieces = []
                for t in g.values():
                    part = math.ceil(t.numel() / world)  # each parameter padded to a multiple of DP
                    padded = torch.zeros(part * world)
                    padded[: t.numel()] = t.reshape(-1)
                    pieces.append(padded[r * part: (r + 1) * part])
                flats.append(torch.cat(pieces))
            module = OrderedDict(**{n: torch.empty(0) for g in groups for n in g}, **buffers)
            torch.save(dict(common, module=module), step_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
            optim_file(r, {"zero_stage": 3, "partition_count": world, "overflow": False,
                           "optimizer_state_dict": {"state": {i: moments(f.numel()) for i, f in enumerate(flats)},
                                                    "param_groups": [dict(hyper, params=[i])
                                                                     for i in range(len(flats))]},
                           "fp32_flat_groups": flats})
    return root


def _groups_like(name: str) -> list[OrderedDict]:
    """The real fixture's parameter groups (names and shapes), with seeded values."""
    import torch

    step = open_step(FIXTURES / name / "global_step2")
    gen = torch.Generator().manual_seed(1)
    return [OrderedDict((n, torch.randn(*s, generator=gen)) for n, s in group) for group in step.shapes]


@pytest.mark.parametrize("name", ["deepspeed_z1_fp32", "deepspeed_z2_fp32", "deepspeed_z3_fp32"])
def test_the_imitation_lays_partitions_out_as_deepspeed(tmp_path, name):
    """The imitation of the tests below, for the real fixture's groups: the same stage, partition
    lengths, paddings and pieces as DeepSpeed's own files, and it reads back its values."""
    import ckpt_tool

    real = open_step(FIXTURES / name / "global_step2")
    groups = _groups_like(name)
    made = imitate(tmp_path / "run", real.stage, groups)
    ours = open_step(made / "global_step1")
    assert ours.stage == real.stage and ours.world == real.world and not ours.mapping.problems
    for r in range(real.world):
        assert [t.size[0] for t in ours.optims[r].flats] == [t.size[0] for t in real.optims[r].flats]
        assert [t.storage.numel for t in ours.optims[r].flats] == [t.storage.numel for t in real.optims[r].flats]
        assert ours.optims[r].group_paddings == real.optims[r].group_paddings
    assert ours.mapping.pieces == real.mapping.pieces
    ck = ckpt_tool.open(str(made))
    for group in groups:
        for n, t in group.items():
            assert np.array_equal(ck[n].read(), t.numpy()), n


def test_partitions_that_do_not_match_the_recorded_shapes(tmp_path, ckpt):
    import torch

    groups = [OrderedDict(a=torch.ones(6, 5), b=torch.ones(7))]
    shapes = [OrderedDict(a=torch.Size([6, 5]), b=torch.Size([9]))]  # 2 more elements than were flattened
    for stage in (2, 3):
        root = imitate(tmp_path / f"z{stage}", stage, groups, shapes=shapes)
        r = ckpt("validate", "--json", root)
        assert r.returncode == 1
        findings = json.loads(r.stdout)["findings"]
        assert findings and all(f["code"] == "bad-metadata" for f in findings), findings
        assert any("do not match the recorded shapes" in f["message"] for f in findings)
        r = ckpt("convert", root, tmp_path / f"out{stage}", "--to", "safetensors", "--skip-unsupported")
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / f"out{stage}").exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_16_bit_buffer_is_given_as_float32(tmp_path, stage):
    """zero_to_fp32 gives floating buffers `.float()` (an fp16 engine's module.half() casts them);
    integer buffers as they are."""
    import torch

    import ckpt_tool

    buffers = OrderedDict(scale=torch.tensor([0.5, 2.0, 1.5 + 2**-9]).to(torch.bfloat16), ids=torch.arange(5))
    root = imitate(tmp_path / "run", stage, [OrderedDict(w=torch.ones(4, 3))], buffers=buffers)
    ck = ckpt_tool.open(str(root))
    assert [leaf.name for leaf in ck.leaves[:3]] == ["scale", "ids", "w"]  # buffers first, in the module's order
    assert (ck["scale"].dtype, ck["ids"].dtype) == ("float32", "int64")
    assert np.array_equal(ck["scale"].read(), buffers["scale"].float().numpy())
    assert np.array_equal(ck["ids"].read(), np.arange(5))


def test_bf16_optimizer_files_are_refused_by_name(tmp_path, ckpt):
    import torch

    root = imitate(tmp_path / "run", 1, [OrderedDict(w=torch.ones(4))], zero_stage=False)
    r = ckpt("inspect", root)
    assert r.returncode == 1 and "BF16_Optimizer" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# no torch, no DeepSpeed; bounded memory
# --------------------------------------------------------------------------------------------

def assert_read_without_torch_or_deepspeed(*paths) -> None:
    """inspect and validate --deep --strict of each path pass in one process that never imports torch,
    deepspeed or jax (shared by the ZeRO, pipeline/MoE and universal tests)."""
    code = (
        "import sys\nfrom ckpt_tool.cli.main import main\n"
        "for path in sys.argv[1:]:\n"
        "    for args in (['inspect', path], ['validate', '--deep', '--strict', path]):\n"
        "        try:\n            main(args)\n        except SystemExit as e:\n            assert e.code == 0, (args, e.code)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'jax')]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr


def test_inspect_and_validate_import_neither_torch_nor_deepspeed():
    assert_read_without_torch_or_deepspeed(FIXTURES / "deepspeed_z2_bf16", FIXTURES / "deepspeed_z3_fp32" / "global_step2")


@pytest.mark.serial
def test_a_parameter_larger_than_memory_streams_in_bands(tmp_path):
    """A 48 MiB parameter of an (imitated) stage-3 checkpoint, its elements split over 2 ranks'
    partitions: converted and deep-validated under --memory 16MiB, the peak stays far below it
    (the scheduler reads bands; each band is a byte range of each rank's partition)."""
    import torch

    gen = torch.Generator().manual_seed(3)
    big = torch.randn(3 * 1024 + 1, 4096, generator=gen)  # odd row count: rank 1's partition ends in padding
    root = imitate(tmp_path / "run", 3, [OrderedDict(big=big, small=torch.ones(3))])
    tiny = imitate(tmp_path / "tiny", 3, [OrderedDict(big=torch.randn(5, 4, generator=gen), small=torch.ones(3))])

    def commands(run: Path, out: Path) -> dict[str, list]:
        return {"convert": ["convert", run, out, "--to", "safetensors", "--exclude", "optimizer/**",
                            "--skip-unsupported", "--memory", "16MiB"],
                "validate": ["validate", "--deep", "--memory", "16MiB", run]}

    # each command on the 48 MiB parameter against the same on a 5x4 one: only what grows with the data
    large, small = commands(root, tmp_path / "out"), commands(tiny, tmp_path / "out_tiny")
    grew = {c: peak_rss_mib(*large[c]) - peak_rss_mib(*small[c]) for c in large}
    assert all(mib < 40 for mib in grew.values()), grew
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("big"), big)
