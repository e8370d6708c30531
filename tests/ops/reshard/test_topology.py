"""Devices for `ckpt reshard` without opening the accelerator (ckpt_tool/ops/topology.py).

No TPU here: the TPU VM is stood in for by its environment variables and a fake
device tree (CKPT_DEV_ROOT points ops/topology.py's /dev at a temporary folder),
and "the accelerator cannot be opened" by JAX_PLATFORMS=tpu on this machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpt_tool.ops.topology import (
    DEV_ROOT_VARIABLE, GENERATIONS, create_device_mesh, host_topology, known_topologies, named_topology,
)
from conftest import ROOT, fixture_path

SRC = str(fixture_path("orbax_ocdbt_zarr2"))

# the issue's TPU VM: a v5litepod-4's variables, one chip passed through
V5E_HOST = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_TOPOLOGY": "2x2", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost",
}


def fake_dev(tmp_path, vfio: int = 0, accel: int = 0, nvidia: int = 0) -> str:
    root = Path(tempfile.mkdtemp(prefix="dev", dir=tmp_path))  # a fresh tree per call
    (root / "vfio").mkdir()
    (root / "vfio" / "vfio").touch()  # the container file every vfio host has: not a chip
    for i in range(vfio):
        (root / "vfio" / str(i)).touch()
    for i in range(accel):
        (root / f"accel{i}").touch()
    for i in range(nvidia):
        (root / f"nvidia{i}").touch()
    (root / "nvidiactl").touch()
    return str(root)


def run_ckpt(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m ckpt_tool ARGS` as conftest's run_ckpt, but with `env` as the WHOLE environment:
    clean_env's removals must hold (an xdist worker's os.environ may carry the JAX_PLATFORMS or
    XLA_FLAGS another test file set)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any TPU/GPU/jax platform variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TPU_") and k not in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", DEV_ROOT_VARIABLE)}
    env.update(extra)
    return env


# -- the host's devices, from the environment and the device files ------------------------------


@pytest.fixture
def dev_root(tmp_path, monkeypatch):
    def make(**counts: int) -> None:
        monkeypatch.setenv(DEV_ROOT_VARIABLE, fake_dev(tmp_path, **counts))
    return make


def test_env_describes_more_chips_than_the_process_sees(dev_root):
    dev_root(vfio=1)
    topo = host_topology(V5E_HOST)
    assert topo is not None and topo.platform == "tpu" and topo.device_ids == (0,)
    assert topo.describe() == "1 TPU v5e chip (from /dev/vfio; the environment describes a v5litepod-4)"


def test_a_whole_host_is_one_host_of_the_slice_the_environment_names(dev_root):
    dev_root(vfio=8)
    topo = host_topology({"TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_TOPOLOGY": "2x4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1",
                          "TPU_HOST_BOUNDS": "1,1,1"})
    assert topo.name == "v5e:2x4" and topo.size == 8 and topo.host_count == 1 and not topo.assumed
    assert topo.describe() == "8 TPU v5e chips of a v5e:2x4 (from /dev/vfio and TPU_ACCELERATOR_TYPE=v5litepod-8)"
    # a pod host: the whole slice, each chip with its host
    dev_root(accel=4)
    topo = host_topology({"TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_TOPOLOGY": "4x4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
                          "TPU_HOST_BOUNDS": "2,2,1", "TPU_WORKER_ID": "3"})
    assert topo.size == 16 and topo.host_count == 4 and "worker 3 of 4 hosts" in topo.source
    assert topo.source.startswith("/dev/accel*")


def test_the_sources_are_cross_checked(dev_root):
    dev_root(vfio=8)
    topo = host_topology({"TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_TOPOLOGY": "4x4", "TPU_HOST_BOUNDS": "1,2,1"})
    assert any("TPU_TOPOLOGY=4x4 disagrees" in a for a in topo.assumed)
    assert any("TPU_HOST_BOUNDS=1,2,1 disagrees" in a for a in topo.assumed)
    # TPU_VISIBLE_CHIPS narrows what the process may use
    topo = host_topology({"TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_VISIBLE_CHIPS": "2,3"})
    assert topo.size == 2 and topo.source == "TPU_VISIBLE_CHIPS with 8 chips in /dev/vfio"
    assert "the environment describes a v5litepod-8" in topo.assumed
    # an accelerator type ckpt cannot map: the chips are counted, their ids assumed and said so
    topo = host_topology({"TPU_ACCELERATOR_TYPE": "v4-8"})
    assert topo.device_ids == tuple(range(8)) and "TPU_ACCELERATOR_TYPE=v4-8 is not a slice ckpt knows" in topo.assumed[0]


def test_what_is_not_a_tpu_host(dev_root):
    dev_root(vfio=2)  # vfio groups without TPU variables: device passthrough, not TPU chips
    assert host_topology({}) is None
    dev_root()
    assert host_topology({"TPU_ACCELERATOR_TYPE": "v5litepod-4"}) is None  # the variables but no chip
    dev_root(vfio=1)
    assert host_topology({**V5E_HOST, "JAX_PLATFORMS": "cpu"}) is None  # the job asked for CPU devices


def test_gpus_are_counted_without_cuda(dev_root):
    dev_root(nvidia=4)
    assert host_topology({}).device_ids == (0, 1, 2, 3)
    topo = host_topology({"CUDA_VISIBLE_DEVICES": "2,3"})
    assert topo.platform == "gpu" and topo.size == 2 and topo.source == "CUDA_VISIBLE_DEVICES"
    assert host_topology({"CUDA_VISIBLE_DEVICES": "-1"}) is None
    assert host_topology({"CUDA_VISIBLE_DEVICES": "0,-1,1"}).size == 1  # CUDA stops at an invalid entry


# -- named slices: jax's ids and mesh order -----------------------------------------------------


def test_named_slices_have_the_runtimes_ids():
    # recorded from jax 0.10.2's get_topology_desc(platform="tpu", topology_name=...) on a v5e host
    assert named_topology("v5e:16x16").device_ids[:16] == (0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23)
    t = named_topology("v5e:4x4")
    assert t.device_ids == (0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15)
    assert t.coords[:6] == ((0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (2, 0, 0), (3, 0, 0))
    assert t.processes == (0,) * 4 + (1,) * 4 + (2,) * 4 + (3,) * 4
    # the same slice by its Cloud TPU names
    assert named_topology("v5litepod-256").device_ids == named_topology("v5e-256").device_ids == \
        named_topology("V5E:16x16").device_ids
    assert named_topology("v5litepod-8").host_count == 1  # a v5e-8 is one VM with all 8 chips
    # a v5e-8 mesh is jax's ring over the tray, not ids 0..7
    assert [t.device_ids[i] for t in [named_topology("v5e:2x4")] for i in t.mesh_order((2, 4))] == [0, 1, 2, 3, 7, 6, 5, 4]


@dataclass(eq=False)
class FakeDevice:
    """What jax's mesh_utils reads of a TPU device."""
    id: int
    coords: tuple[int, int, int]
    device_kind: str
    process_index: int
    core_on_chip: int = 0
    platform: str = "tpu"


def _mesh_shapes(n: int) -> list[tuple[int, ...]]:
    shapes = [(n,), (1, n), (n, 1)] + [(a, n // a) for a in (2, 4, 8, 16, 32) if n % a == 0 and a < n]
    return shapes + ([(2, 2, n // 4)] if n % 4 == 0 and n >= 8 else [])


def test_mesh_order_is_jax_mesh_utils_order():
    mesh_utils = pytest.importorskip("jax.experimental.mesh_utils")
    compared = 0
    for name in known_topologies():
        topo = named_topology(name)
        gen = GENERATIONS[name.split(":")[0]]
        devices = [FakeDevice(i, c, gen.device_kind, p) for i, c, p in zip(topo.device_ids, topo.coords, topo.processes)]
        for shape in _mesh_shapes(topo.size):
            for split in (False, True):
                try:
                    theirs = [d.id for d in mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split).flat]
                except (ValueError, NotImplementedError):
                    theirs = None
                try:
                    mine = [topo.device_ids[i] for i in create_device_mesh(shape, topo.coords, split=split).flat]
                except ValueError:
                    mine = None
                assert mine == theirs, (name, shape, split)
                compared += 1
    assert compared > 200


def test_named_slices_agree_with_get_topology_desc():
    """On a TPU host with a free chip (the lead's device run): jax's own description of each slice."""
    if not os.environ.get("TPU_ACCELERATOR_TYPE"):
        pytest.skip("not a TPU VM")
    topologies = pytest.importorskip("jax.experimental.topologies")
    import jax

    for name in ["v5e:2x2", "v5e:4x4", "v5e:8x16", "v5e:16x16", "v6e:16x16"]:
        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
        topo = named_topology(name)
        assert [d.id for d in devices] == list(topo.device_ids)
        assert [tuple(d.coords) for d in devices] == list(topo.coords)
        for shape in _mesh_shapes(len(devices)):
            try:
                theirs = [d.id for d in jax.make_mesh(shape, tuple("abc"[:len(shape)]), devices=devices).devices.flat]
            except (ValueError, NotImplementedError):
                continue
            assert [topo.device_ids[i] for i in topo.mesh_order(shape)] == theirs, (name, shape)


# -- the command --------------------------------------------------------------------------------


def test_reshard_on_a_tpu_host_needs_no_jax(tmp_path):
    """The issue's host: a reshard learns its one chip from /dev and the environment; jax is never imported."""
    env = clean_env(**V5E_HOST, **{DEV_ROOT_VARIABLE: fake_dev(tmp_path, vfio=1)})
    probe = ("import sys, time; t = time.perf_counter(); from ckpt_tool.cli.main import _run; "
             "from ckpt_tool.ops.reshard import ReshardOptions, resolve_mesh; "
             "d = time.perf_counter(); resolve_mesh(ReshardOptions(mesh='data=1,model=1'), 1); "
             "d = time.perf_counter() - d; "
             f"code = _run(['reshard', {SRC!r}, sys.argv[1], '--mesh', 'data=1,model=1', '--json']); "
             "print(round(d, 3), round(time.perf_counter() - t, 3), file=sys.stderr); "
             "assert 'jax' not in sys.modules, 'jax was imported'; sys.exit(code)")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "out")], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["mesh"]["origin"] == "host" and summary["mesh"]["platform"] == "tpu"
    assert summary["mesh"]["source"] == "1 TPU v5e chip (from /dev/vfio; the environment describes a v5litepod-4)"
    # the issue: 17 s of a 20 s reshard went on opening the chip; the files and variables take milliseconds
    # (bounds loose enough for a loaded 2-core CI machine)
    discovery, whole = map(float, r.stderr.strip().splitlines()[-1].split())
    assert discovery < 1.0, f"learning the devices took {discovery} s"
    assert whole < 10.0, f"a 3 KiB reshard took {whole} s"
    # the plain output says where the device came from
    r = run_ckpt("reshard", SRC, str(tmp_path / "out2"), "--mesh", "data=1,model=1", env=env)
    assert r.returncode == 0, r.stderr
    assert "devices: 1 TPU v5e chip (from /dev/vfio; the environment describes a v5litepod-4)" in r.stdout


def test_a_mesh_larger_than_the_host_names_the_options(tmp_path):
    env = clean_env(**V5E_HOST, **{DEV_ROOT_VARIABLE: fake_dev(tmp_path, vfio=1)})
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=2,model=4", env=env)
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert "needs 8 devices but this job has 1 TPU v5e chip (from /dev/vfio; the environment describes a v5litepod-4); " \
           "pass --devices 8 or --topology NAME" in r.stderr


def test_an_accelerator_that_cannot_be_opened_is_one_line(tmp_path):
    """JAX_PLATFORMS=tpu on a machine without one stands in for a chip another job holds."""
    if os.environ.get("TPU_ACCELERATOR_TYPE") or any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0")):
        pytest.skip("a machine that may have a TPU: JAX_PLATFORMS=tpu would open it")
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=1", env=clean_env(JAX_PLATFORMS="tpu"))
    assert r.returncode == 1 and not (tmp_path / "out").exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: jax cannot open this machine's devices (")
    assert "--devices N" in lines[0] and "--topology NAME" in lines[0]
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr


def test_the_lock_file_advice_is_dropped():
    from ckpt_tool.ops.reshard import _backend_failure

    held = RuntimeError("Unable to initialize backend 'tpu': ABORTED: Internal error when accessing libtpu multi-process "
                        'lockfile. Run "$ sudo rm /tmp/libtpu_lockfile".')
    assert _backend_failure(held) == ("Unable to initialize backend 'tpu': ABORTED: Internal error when accessing "
                                      "libtpu multi-process lockfile.")


def test_topology_option(tmp_path):
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=16,model=16", "--fsdp", "data",
                 "--topology", "v5e:16x16", "--num-processes", "64", "--dry-run", "--json", env=clean_env())
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    mesh = plan["mesh"]
    assert mesh["origin"] == "--topology" and mesh["processes"] == 64
    assert mesh["source"] == "256 TPU v5e chips of a v5e:16x16 (from --topology v5e:16x16)"
    assert mesh["device_ids"] == [named_topology("v5e:16x16").device_ids[i] for i in
                                  named_topology("v5e:16x16").mesh_order((16, 16))]
    assert len(plan["processes"]) == 64
    # the text plan names it too; a v5e-8's ring order is recorded
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=2,model=4", "--topology", "v5litepod-8",
                 "--dry-run", env=clean_env())
    assert r.returncode == 0, r.stderr
    assert "data=2,model=4: 8 devices (--topology, ids 0, 1, 2, 3, 7, 6, 5, 4)" in r.stdout
    assert "8 TPU v5e chips of a v5e:2x4 (from --topology v5litepod-8)" in r.stdout
    # a real reshard for it records the same ids, without any device
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=2,model=4", "--topology", "v5e:2x4", "--json",
                 env=clean_env(JAX_PLATFORMS="tpu"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["mesh"]["device_ids"] == [0, 1, 2, 3, 7, 6, 5, 4]


def test_topology_mistakes(tmp_path):
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=8", "--topology", "v5e:3x3")
    assert r.returncode == 2 and "--topology 'v5e:3x3' is not a slice ckpt knows; known: v5e:1x1, v5e:2x2" in r.stderr
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=8", "--topology", "v5e:2x4", "--devices", "8")
    assert r.returncode == 2 and "--devices and --topology both" in r.stderr
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=4", "--topology", "v5e:2x4")
    assert r.returncode == 2 and "needs 4 devices but this job has 8 TPU v5e chips of a v5e:2x4" in r.stderr


def test_cpu_machines_still_ask_jax(tmp_path):
    """No accelerator to see: jax's CPU devices, which open at once and take nothing (XLA_FLAGS honoured)."""
    # JAX_PLATFORMS=cpu: on a TPU VM (the lead's device run) jax would otherwise open the chip
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
                    **{DEV_ROOT_VARIABLE: fake_dev(tmp_path)})
    r = run_ckpt("reshard", SRC, str(tmp_path / "out"), "--mesh", "data=2,model=2", "--json", env=env)
    assert r.returncode == 0, r.stderr
    mesh = json.loads(r.stdout)["mesh"]
    assert mesh["origin"] == "jax" and mesh["platform"] == "cpu" and mesh["source"] is None


def test_named_slices_agree_with_jax_on_a_tpu_host():
    """ids, coordinates and jax.make_mesh's order as jax 0.10.2 gave them on a v5e host (recorded
    there by the lead's device probe; tests/data/jax_v5e_topologies.json says how)."""
    recorded = json.loads((Path(__file__).parents[2] / "data" / "jax_v5e_topologies.json").read_text())["slices"]
    meshes = 0
    for name, jax_slice in recorded.items():
        topo = named_topology(name)
        assert list(topo.device_ids) == jax_slice["ids"], name
        assert [list(c) for c in topo.coords] == jax_slice["coords"], name
        for shape_text, jax_ids in jax_slice["make_mesh"].items():
            shape = tuple(int(s) for s in shape_text.strip("()").split(",") if s.strip())
            assert [topo.device_ids[i] for i in topo.mesh_order(shape)] == jax_ids, (name, shape)
            meshes += 1
    assert len(recorded) == 7 and meshes >= 20
