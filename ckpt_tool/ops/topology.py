"""The devices a reshard lays out for, learned without opening an accelerator.

Storage work must not need the chip: opening the TPU runtime takes most of a
reshard's time, and fails outright while a training job holds the chip
(libtpu allows one process). So the host's devices come from what the machine
shows without a backend, in this order of trust:

1. what the user said: `--devices N` (in ops/reshard.py) or `--topology NAME`;
2. on a TPU VM, the chips this process can use (/dev/accel*, /dev/vfio/N,
   narrowed by TPU_VISIBLE_CHIPS), read with the slice the environment
   describes (TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_CHIPS_PER_HOST_BOUNDS,
   TPU_HOST_BOUNDS, TPU_WORKER_ID). The two are cross-checked: the
   environment can describe more chips than the process may use (a
   v5litepod-4's variables with one chip passed through), and then the chips
   the process can use win and the plan says so;
3. on a GPU node, CUDA_VISIBLE_DEVICES or the /dev/nvidiaN files (opening
   CUDA is slow too, and jax would preallocate memory on a busy GPU);
4. otherwise jax's own devices (Topology is None here; ops/reshard.py asks jax):
   a CPU backend opens in milliseconds and takes nothing from anyone, and it
   honours XLA_FLAGS / jax.distributed exactly as the job's own jax does.

A TPU slice's mesh order is jax's (mesh_utils.create_device_mesh, as
jax.make_mesh calls it), ported below so that it needs neither jax nor libtpu
and works on any machine. No jax import here.
"""
from __future__ import annotations

import collections
import itertools
import math
import os
import re
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np

from ..base.errors import UsageError

# the device files are looked for under this root; tests point it at a fake /dev tree
DEV_ROOT_VARIABLE = "CKPT_DEV_ROOT"

Coord = tuple[int, int, int]


@dataclass(frozen=True)
class Generation:
    """A TPU generation whose slices are 2-D tori of single-core chips (v5e, v6e)."""

    name: str  # "v5e": the prefix of jax's topology names (v5e:2x4)
    pod_prefix: str  # "v5litepod": TPU_ACCELERATOR_TYPE's (v5litepod-8)
    device_kind: str  # what jax reports as device_kind (its mesh_utils picks the chip's handler by it)
    # chips -> the slice's physical shape (x, y); these are the slices Cloud TPU offers
    shapes: Mapping[int, tuple[int, int]]
    # jax.make_mesh lets only v5e split a physical axis over two logical ones
    split_physical_axes: bool


_SLICES = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
GENERATIONS = {
    g.name: g for g in (
        Generation("v5e", "v5litepod", "TPU v5 lite", _SLICES, True),
        Generation("v6e", "v6e", "TPU v6 lite", _SLICES, False),
    )
}


@dataclass(frozen=True)
class Topology:
    """Devices to lay a mesh over: their ids, coordinates and owning hosts, and where that came from."""

    platform: str  # "tpu" or "gpu"
    device_ids: tuple[int, ...]  # in the order the runtime enumerates them
    processes: tuple[int, ...]  # the host (process) owning each device
    source: str  # which source was used, for the plan: "/dev/vfio", "--topology v5e:2x4", ...
    kind: str  # "TPU v5e", "GPU"
    name: str | None = None  # the named slice, e.g. "v5e:2x4"
    coords: tuple[Coord, ...] | None = None  # TPU chip coordinates (x, y, z), same order as device_ids
    split_physical_axes: bool = False
    assumed: tuple[str, ...] = field(default_factory=tuple)  # what was assumed or disagreed, one line each

    @property
    def size(self) -> int:
        return len(self.device_ids)

    @property
    def host_count(self) -> int:
        return max(self.processes) + 1 if self.processes else 1

    def describe(self) -> str:
        """E.g. '1 TPU v5 lite chip (from /dev/vfio; the environment describes a v5litepod-4)'."""
        unit = "chip" if self.platform == "tpu" else "device"
        what = f"{self.size} {self.kind} {unit}{'s' * (self.size != 1)}"
        if self.name:
            what += f" of a {self.name}"
        return f"{what} (from {'; '.join((self.source, *self.assumed))})"

    def mesh_order(self, shape: Sequence[int]) -> list[int]:
        """Indices into device_ids in the order jax lays a mesh of `shape` over them (flattened)."""
        if self.coords is None or self.platform != "tpu":
            return list(range(self.size))  # jax's GPU order: by id, which is enumeration order here
        try:
            return [int(i) for i in create_device_mesh(shape, self.coords, split=self.split_physical_axes).flat]
        except ValueError:  # a shape the torus cannot take; jax.make_mesh fails there, ops/reshard.py's fallback too
            return list(range(self.size))


# -- named slices ----------------------------------------------------------------------------


def known_topologies() -> list[str]:
    return [f"{g.name}:{x}x{y}" for g in GENERATIONS.values() for x, y in g.shapes.values()]


def _parse_name(name: str) -> tuple[Generation, tuple[int, int]] | None:
    """'v5e:2x4' / 'v5litepod-8' / 'v5e-8' -> (generation, (x, y)); None if not a known slice."""
    text = name.strip().lower()
    for g in GENERATIONS.values():
        m = re.fullmatch(rf"{g.name}:(\d+)x(\d+)(?:x1)?", text)
        if m:
            shape = (int(m[1]), int(m[2]))
            return (g, shape) if shape in g.shapes.values() else None
        m = re.fullmatch(rf"(?:{g.name}|{g.pod_prefix})-(\d+)", text)
        if m:
            chips = int(m[1])
            return (g, g.shapes[chips]) if chips in g.shapes else None
    return None


def chips_per_host(shape: tuple[int, int]) -> tuple[int, int]:
    """A host's block of chips: a slice of up to 8 chips is one host (v5litepod-8: 2x4 on one VM);
    larger ones have 2x2 per host. (get_topology_desc assumes 2x2 hosts everywhere unless told.)"""
    return shape if shape[0] * shape[1] <= 8 else (2, 2)


def named_topology(name: str, source: str | None = None, assumed: Sequence[str] = (),
                   per_host: tuple[int, int] | None = None) -> Topology:
    """The chips of a named slice, in the runtime's id order, each with its host.

    Ids and coordinates are those jax's get_topology_desc reports for the slice
    (checked on a v5e host for every slice in GENERATIONS): chip (x, y) has id
    x + y * width, and the runtime enumerates the chips host by host.
    """
    parsed = _parse_name(name)
    if parsed is None:
        raise UsageError(f"--topology {name!r} is not a slice ckpt knows; known: {', '.join(known_topologies())}; "
                         "or pass --devices N for N devices with ids 0..N-1")
    gen, (sx, sy) = parsed
    hx, hy = per_host or chips_per_host((sx, sy))
    if sx % hx or sy % hy:
        raise UsageError(f"a {hx}x{hy} block of chips per host does not tile the {sx}x{sy} slice {name}")
    coords: list[Coord] = []
    hosts: list[int] = []
    # enumerated host by host (hosts row-major over the slice), row-major within a host
    for host_y in range(sy // hy):
        for host_x in range(sx // hx):
            for y in range(hy):
                for x in range(hx):
                    coords.append((host_x * hx + x, host_y * hy + y, 0))
                    hosts.append(host_y * (sx // hx) + host_x)
    ids = tuple(_device_id(c, (sx, sy)) for c in coords)
    return Topology(
        "tpu", ids, tuple(hosts), source or f"--topology {name}", f"TPU {gen.name}", f"{gen.name}:{sx}x{sy}",
        tuple(coords), gen.split_physical_axes, tuple(assumed),
    )


def _device_id(coord: Coord, shape: tuple[int, int]) -> int:
    """A v5e/v6e chip's device id: row-major over the slice's chip coordinates."""
    return coord[0] + coord[1] * shape[0]


# -- the host, without a backend ---------------------------------------------------------------


def _dev(pattern: str) -> list[str]:
    import glob  # (a host learned from its devices only: --devices and --topology look at none)

    root = os.environ.get(DEV_ROOT_VARIABLE, "/dev")
    return sorted(glob.glob(os.path.join(root, pattern)))


def _bounds(env: Mapping[str, str], name: str) -> tuple[int, ...] | None:
    """A bounds variable ("2,2,1"): None when unset or not a list of numbers; a 0 stays in (the
    caller says it does not tile), as nothing here may divide by it."""
    text = env.get(name, "").strip()
    if not re.fullmatch(r"[0-9]{1,9}(,[0-9]{1,9})*", text):
        return None
    return tuple(int(v) for v in text.split(","))


def _platforms(env: Mapping[str, str]) -> set[str] | None:
    """JAX_PLATFORMS as a set (None: unset, every platform allowed)."""
    text = env.get("JAX_PLATFORMS", "").strip()
    return {p.strip().lower() for p in text.split(",") if p.strip()} if text else None


def host_topology(env: Mapping[str, str] | None = None) -> Topology | None:
    """This host's accelerators without opening them, or None where there are none to see (ask jax then)."""
    env = os.environ if env is None else env
    allowed = _platforms(env)
    if allowed is None or "tpu" in allowed:
        tpu = _tpu_host(env)
        if tpu is not None:
            return tpu
    if allowed is None or allowed & {"cuda", "gpu"}:
        return _gpu_host(env)
    return None


def _visible_tpu_chips(env: Mapping[str, str]) -> tuple[list[int], str] | None:
    """The chip indices this process may use, and where that was read."""
    files = [f for f in _dev("accel*") if re.fullmatch(r"accel\d+", os.path.basename(f))]
    where = "/dev/accel*"
    if not files:
        files = [f for f in _dev("vfio/*") if os.path.basename(f).isdigit()]
        where = "/dev/vfio"
    visible = env.get("TPU_VISIBLE_CHIPS", "").strip()
    if re.fullmatch(r"[0-9]{1,9}(,[0-9]{1,9})*", visible):  # (ASCII digits, each a plausible chip index)
        chips = sorted({int(v) for v in visible.split(",")})
        return chips, ("TPU_VISIBLE_CHIPS" + (f" with {len(files)} chips in {where}" if files else ""))
    if not files:
        return None
    return list(range(len(files))), where


def _tpu_host(env: Mapping[str, str]) -> Topology | None:
    accel = env.get("TPU_ACCELERATOR_TYPE", "").strip()
    visible = _visible_tpu_chips(env)
    # /dev/vfio groups exist on any VM with device passthrough: they mean TPU chips only on a TPU VM
    if visible is None or (not accel and visible[1] == "/dev/vfio"):
        return None
    chips, where = visible
    assumed: list[str] = []
    parsed = _parse_name(accel) if accel else None
    if parsed is None:
        kind = "TPU"
        if accel:
            assumed.append(f"TPU_ACCELERATOR_TYPE={accel} is not a slice ckpt knows; chip ids 0..{len(chips) - 1} assumed")
        else:
            assumed.append(f"no TPU_ACCELERATOR_TYPE; chip ids 0..{len(chips) - 1} assumed")
        return Topology("tpu", tuple(range(len(chips))), (0,) * len(chips), where, kind, assumed=tuple(assumed))
    gen, shape = parsed
    topo_var = env.get("TPU_TOPOLOGY", "").strip().lower()
    if topo_var and topo_var not in (f"{shape[0]}x{shape[1]}", f"{shape[0]}x{shape[1]}x1"):
        assumed.append(f"TPU_TOPOLOGY={topo_var} disagrees with TPU_ACCELERATOR_TYPE={accel}; the latter used")
    slice_name = f"{gen.name}:{shape[0]}x{shape[1]}"
    per_host = chips_per_host(shape)
    env_per_host = _bounds(env, "TPU_CHIPS_PER_HOST_BOUNDS")
    if env_per_host is not None:
        if len(env_per_host) == 3 and env_per_host[2] == 1 and min(env_per_host) >= 1 \
                and shape[0] % env_per_host[0] == 0 and shape[1] % env_per_host[1] == 0:
            per_host = (env_per_host[0], env_per_host[1])  # the VM's own word on its block of chips
        else:
            assumed.append(f"TPU_CHIPS_PER_HOST_BOUNDS={','.join(map(str, env_per_host))} does not tile a {accel}; "
                           f"{per_host[0]}x{per_host[1]} chips per host assumed")
    host_chips = per_host[0] * per_host[1]
    if len(chips) == host_chips:
        # the process can use all of its host's chips: it is one host of the slice the environment describes
        hosts = (shape[0] // per_host[0]) * (shape[1] // per_host[1])
        env_hosts = _bounds(env, "TPU_HOST_BOUNDS")
        if env_hosts is not None and math.prod(env_hosts) != hosts:
            assumed.append(f"TPU_HOST_BOUNDS={','.join(map(str, env_hosts))} disagrees with a {accel}'s {hosts} hosts")
        note = f"{where} and TPU_ACCELERATOR_TYPE={accel}"
        if hosts > 1:
            worker = env.get("TPU_WORKER_ID", "?")
            note += f", worker {worker} of {hosts} hosts"
        return named_topology(slice_name, source=note, assumed=assumed, per_host=per_host)
    # fewer (or more) chips than the environment's host has: what the process can use wins
    assumed.insert(0, f"the environment describes a {accel}")
    if len(chips) > host_chips:
        assumed.insert(1, f"{len(chips)} chips seen but a {accel} host has {host_chips}")
    n = len(chips)
    return Topology("tpu", tuple(range(n)), (0,) * n, where, f"TPU {gen.name}", None,
                    tuple((i, 0, 0) for i in range(n)), gen.split_physical_axes, tuple(assumed))


def _gpu_host(env: Mapping[str, str]) -> Topology | None:
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [e.strip() for e in listed.split(",") if e.strip()]
        # CUDA stops at the first invalid entry ("-1" hides every GPU)
        count = next((i for i, e in enumerate(entries) if e.startswith("-")), len(entries))
        if count == 0:
            return None
        source = "CUDA_VISIBLE_DEVICES"
    else:
        count = len([f for f in _dev("nvidia*") if re.fullmatch(r"nvidia\d+", os.path.basename(f))])
        if count == 0:
            return None
        source = "/dev/nvidia*"
    return Topology("gpu", tuple(range(count)), (0,) * count, source, "GPU")


# -- jax's mesh order (jax/_src/mesh_utils.py, Apache-2.0), over chip coordinates --------------
#
# Each function mirrors its namesake in jax 0.10 mesh_utils; devices are indices
# into `coords`. Kept to what v5e/v6e slices reach (one core per chip).

_TRAY_2x2_RING_ORDER = (0, 1, 3, 2)
_TRAY_4x4_RING_ORDER = (0, 1, 2, 3, 7, 6, 5, 9, 10, 11, 15, 14, 13, 12, 8, 4)
_V5E_TRAY_RING_ORDER = (0, 1, 2, 3, 7, 6, 5, 4)
_V5E_TRAY_IOTA_ORDER = (0, 4, 2, 6, 1, 5, 3, 7)


def create_device_mesh(shape: Sequence[int], coords: Sequence[Coord], *, split: bool) -> np.ndarray:
    """Device indices shaped as the logical mesh, as jax.make_mesh places v5e/v6e chips."""
    shape = tuple(int(s) for s in shape)
    if math.prod(shape) != len(coords):
        raise ValueError(f"{len(coords)} devices cannot form a mesh of shape {shape}")
    special = _v5e_create_device_mesh(shape, coords)
    if special is not None:
        return special
    physical = _physical_mesh(coords)
    return _nd_torus(physical, shape, split=split)


def _v5e_create_device_mesh(shape: tuple[int, ...], coords: Sequence[Coord]) -> np.ndarray | None:
    bx, by, bz = (max(c[i] for c in coords) + 1 for i in range(3))
    sequential = np.array(sorted(range(len(coords)), key=lambda i: tuple(reversed(coords[i]))))
    if bx == by == 2 and bz == 1 and len(coords) == 4:
        return sequential[np.array(_TRAY_2x2_RING_ORDER)].reshape(shape)
    if len(coords) == 8:
        order = _V5E_TRAY_IOTA_ORDER if bx == by == bz == 2 else _V5E_TRAY_RING_ORDER
        return sequential[np.array(order)].reshape(shape)
    if bx == by == 4 and bz == 1 and len(coords) == 16 and max(shape) == 16:
        return sequential[np.array(_TRAY_4x4_RING_ORDER)].reshape(shape)
    return None


def _physical_mesh(coords: Sequence[Coord]) -> np.ndarray:
    lo = [min(c[i] for c in coords) for i in range(3)]
    dims = tuple(max(c[i] for c in coords) - lo[i] + 1 for i in range(3))
    if math.prod(dims) != len(coords):
        raise ValueError(f"chip coordinates do not fill a {dims} cuboid")
    out = np.full(dims, -1, dtype=np.int64)
    for i, c in enumerate(coords):
        out[c[0] - lo[0], c[1] - lo[1], c[2] - lo[2]] = i
    if (out < 0).any():
        raise ValueError("chip coordinates leave a hole in the cuboid")
    return out


def _nd_torus(physical: np.ndarray, shape: tuple[int, ...], *, split: bool) -> np.ndarray:
    assignable = list(physical.shape)
    assignment: list[tuple[int, ...]] = [() for _ in shape]
    # the last logical axis is the most network-intensive: it is placed first
    for axis, size in reversed(list(enumerate(shape))):
        for num_axes in range(len(physical.shape), 0, -1):
            for elem in itertools.combinations(enumerate(assignable), num_axes):
                indices, sizes = zip(*elem)
                if math.prod(sizes) == size:
                    assignment[axis] = indices
                    assignable = [0 if i in indices else v for i, v in enumerate(assignable)]
                    break
            if assignment[axis]:
                break
        else:
            if size > 1:
                if not split:
                    raise ValueError(f"mesh axis {axis} of size {size} fits no product of the physical axes left")
                return _nd_torus_splitting_axes(physical, shape)
    transpose = [int(p) for axes in assignment for p in axes]
    return physical.transpose(transpose).reshape(shape)


def _prime_factors(x: int) -> list[int]:
    factors = []
    for p in range(2, math.isqrt(x) + 2):
        while x % p == 0:
            factors.append(p)
            x //= p
        if x == 1:
            return factors
    return [x]


def _feasible_assignments(physical_shape: Sequence[int], assignment: np.ndarray, size: int) -> Iterator[np.ndarray]:
    wanted: dict[int, int] = collections.defaultdict(int)
    for f in _prime_factors(size):
        wanted[f] += 1
    available = np.array(physical_shape) // np.prod(assignment, axis=-1)
    by_factor: dict[int, list[int]] = collections.defaultdict(list)
    for axis, axis_size in enumerate(available):
        for f in _prime_factors(int(axis_size)):
            if f in wanted:
                by_factor[f].append(axis)
    factors = list(wanted)
    choices = [set(itertools.combinations(by_factor[f], wanted[f])) for f in factors]
    for pick in itertools.product(*choices):
        result = np.ones([len(physical_shape)], dtype=np.int64)
        for fi, axes in enumerate(pick):
            for a in axes:
                result[a] *= factors[fi]
        yield result


def _prefer_first(x: np.ndarray, y: np.ndarray, physical_shape: Sequence[int], assignment: np.ndarray) -> bool:
    def whole(a: np.ndarray) -> int:
        return int(np.prod([s for i, s in enumerate(a) if s == physical_shape[i]]))

    def whole_axes(a: np.ndarray) -> int:
        return len([1 for i, s in enumerate(a) if s == physical_shape[i] and s > 1])

    taken = np.prod(assignment, axis=-1)

    def overlapping(a: np.ndarray) -> int:
        return int(np.prod([s for i, s in enumerate(a) if taken[i] > 1]))

    for key in (whole, whole_axes, overlapping):
        if key(x) != key(y):
            return key(x) > key(y)
    return tuple(x) > tuple(y)


def _nd_torus_splitting_axes(physical: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    pshape = physical.shape
    assignment = np.ones([len(pshape), len(shape)], dtype=np.int64)
    for axis, size in reversed(list(enumerate(shape))):
        best: np.ndarray | None = None
        for candidate in _feasible_assignments(pshape, assignment, size):
            if best is None or _prefer_first(candidate, best, pshape, assignment):
                best = candidate
        if best is None:  # as jax: no way to give this logical axis its size over the physical ones
            raise ValueError(f"no assignment of physical axes {pshape} to mesh axis {axis} of size {size}")
        assignment[:, axis] = best
    physical_idx = np.broadcast_to(np.arange(len(pshape))[:, None], assignment.shape).reshape(-1)
    logical_idx = np.broadcast_to(np.arange(len(shape))[None, :], assignment.shape).reshape(-1)
    logical = np.reshape(physical, assignment.reshape(-1))
    _, _, order = zip(*sorted(zip(logical_idx, physical_idx, range(len(logical_idx)))))
    return np.reshape(np.transpose(logical, order), shape)
