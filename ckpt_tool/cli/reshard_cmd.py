"""`ckpt reshard SRC DST --mesh data=2,model=4`: lay a checkpoint out for a new mesh."""
from __future__ import annotations

import math
import sys
from contextlib import nullcontext

import click

from ..ops.reshard import ReshardOptions, ReshardPlan, format_spec, plan_reshard, reshard
from .. import formats
from .helptext import formats_read
from .progress import progress_for
from .options import may_join, memory_option, multihost_options, output_options
from .render import Output, esc, human_bytes, human_rate, plural, process_note


# the formats it reads and writes come from the registry (helptext), so that the list cannot go stale
@click.command("reshard", help=(
    f"Write SRC (any format ckpt reads: {formats_read()}) into DST as an "
    f"{formats.reshard_format().label} checkpoint laid out for a new device mesh: each array keeps its recorded "
    "partition spec where it fits the new mesh (else that dimension is replicated) unless --rules or --fsdp say "
    "otherwise. Every spec is checked before DST is created; SRC is never written. Run the same command on every "
    "host to split the work."))
@click.argument("src")
@click.argument("dst")
@click.option("--mesh", required=True, metavar="AXIS=SIZE,...", help="The new mesh's axes and sizes, e.g. data=2,model=4.")
@click.option("--devices", type=click.IntRange(min=1), metavar="N",
              help="Lay out for N devices (ids 0..N-1) instead of this machine's devices; needs no device.")
@click.option("--topology", metavar="NAME",
              help="Lay out for a TPU slice (v5e:2x4, v5e:16x16, v5litepod-8, v6e-256), its chips in the order jax "
                   "lays a mesh over them, instead of this machine's devices; needs no device.")
@click.option("--rules", "rules", metavar="FILE",
              help="A JSON or TOML file of [regex, partition spec] rules; each regex is searched in the "
                   "'/'-joined keys, the first match wins. "
                   'JSON: [["kernel$", [null, "model"]], [".*", []]]; '
                   'TOML: rules = [["kernel$", ["", "model"]], [".*", []]] ("" for null). '
                   "More: docs/commands/reshard.md.")
@click.option("--fsdp", metavar="AXIS", help="Also shard each array's largest divisible unsharded dimension over AXIS.")
@click.option("--host-arrays-to-mesh", is_flag=True,
              help="Lay host numpy arrays (saved as np.ndarray, with no sharding) out on the mesh as jax arrays, by "
                   "--rules, then --fsdp, else replicated. Without it they stay host arrays, copied as they are.")
@click.option("--select", multiple=True, metavar="GLOB",
              help="Keep only leaves whose '/'-joined keys or dotted names match, as for convert (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Drop leaves whose keys or dotted names match, e.g. 'opt_state/**' (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the plan (specs, shard shapes, bytes per process, memory per device); write nothing.")
@output_options
@memory_option
@multihost_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the plan with --dry-run, else a summary).")
def reshard_command(
    src: str, dst: str, mesh: str, devices: int | None, topology: str | None, rules: str | None, fsdp: str | None, dry_run: bool,
    zarr3: bool, skip_unsupported: bool, overwrite: bool, step: str | None, workers: int,
    coordinator: str | None, num_processes: int | None, process_id: int | None, as_json: bool, memory: int,
    select: tuple[str, ...], exclude: tuple[str, ...], host_arrays_to_mesh: bool,
) -> None:
    # base/distributed.py where a multi-process run may be asked for only (options.may_join)
    joins = may_join(coordinator, num_processes, process_id)
    if joins:
        from ..base.distributed import TORCH, join, process_spec

        processes = process_spec(coordinator, num_processes, process_id).num_processes
    opts = ReshardOptions(
        mesh=mesh, devices=devices, topology=topology, rules=rules, fsdp=fsdp, zarr3=zarr3, workers=workers,
        overwrite=overwrite, step=step, skip_unsupported=skip_unsupported, memory=memory,
        select=list(select), exclude=list(exclude), host_arrays_to_mesh=host_arrays_to_mesh,
    )
    if dry_run and (devices is not None or topology is not None):
        # a plan for hypothetical devices needs neither devices nor the other hosts
        opts.process_count = processes if joins else None
        plan = plan_reshard(src, dst, opts)
        _show_plan(Output(json_mode=as_json), plan, as_json)
        sys.exit(0 if plan.ok else 1)
    # the other processes (flags, JAX_*, torchrun or Slurm variables); None alone
    coord = join(coordinator, num_processes, process_id) if joins else None
    # after the coordinator, which moves sys.stdout away from fd 1 (gloo's chatter)
    out = Output(json_mode=as_json)
    with coord or nullcontext():
        if coord is not None and coord.kind == TORCH and devices is None and topology is None:
            # without jax.distributed there are no global jax devices: the mesh's devices are
            # ids 0..N-1, each process owning an equal run of them, as with --devices N
            opts.devices = _mesh_devices(mesh, coord.process_count)
        if dry_run:
            plan = plan_reshard(src, dst, opts, coordinator=coord)
            _show_plan(out, plan, as_json)
            sys.exit(0 if plan.ok else 1)
        with progress_for(out, "resharding") as progress:
            result = reshard(src, dst, opts, progress=progress, coordinator=coord)
    if as_json:
        out.json({"ok": True, **result.to_json()})  # the --json contract (docs/commands/): "ok" as the exit status says
        return
    plan = result.plan
    for line in result.cleanup:  # temporary outputs of killed runs beside DST: removed, or left and why
        out.line(f"[yellow]{esc(line)}[/yellow]")
    # one line per distinct note (a model repeats the same reason for many layers); --dry-run has them per leaf
    by_note: dict[str, list[str]] = {}
    for lp in plan.leaves:
        for note in lp.notes:
            by_note.setdefault(note, []).append(lp.path)
    for note, paths in by_note.items():
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        out.line(f"[yellow]{esc(note)}[/yellow]: {esc(', '.join(paths[:3]))}{more}")
    for path, reason in plan.skipped:
        out.line(f"[yellow]skipped[/yellow] {esc(path)}: {esc(reason)}")
    host = plan.host_arrays
    if host:  # else "0 B per device" of a checkpoint of numpy arrays reads as if nothing was laid out
        more = f" and {len(host) - 3} more" if len(host) > 3 else ""
        out.line(f"[yellow]{plural(len(host), 'host array')}[/yellow] ({esc(', '.join(lp.path for lp in host[:3]))}{more}), "
                 "saved as numpy with no sharding, stay so: orbax restores them on no device "
                 "(--host-arrays-to-mesh lays them out on the mesh)")
    if plan.mesh.source:  # learned without jax: say from where, and what was assumed
        out.line(f"devices: {esc(plan.mesh.source)}")
    where = process_note(result.process_index, result.process_count)
    out.line(
        f"[bold green]resharded[/bold green] {esc(src)} ({plan.source_format}) -> {esc(dst)} for mesh "
        f"{esc(plan.mesh.describe())} ({plural(plan.mesh.size, 'device')}){where}: {plural(len(plan.leaves), 'array')}, "
        f"{plural(len(plan.values), 'value')}, {plural(result.chunks, 'chunk')}, {human_bytes(result.bytes)} in {result.seconds:.1f} s "
        f"({human_rate(result.bytes, result.seconds)}); {human_bytes(plan.device_bytes)} per device after restore"
        + (f", {human_bytes(plan.host_bytes)} in host arrays" if host else "")
    )


def _mesh_devices(mesh: str, processes: int) -> int:
    from ..base.errors import UsageError
    from ..ops.reshard import parse_mesh

    size = math.prod(n for _, n in parse_mesh(mesh))
    if size % processes:
        raise UsageError(f"--mesh {mesh} has {size} devices, which {processes} processes cannot own in equal "
                         "shares (a run coordinated through torch gives each process N/P of the mesh's devices)")
    return size


def _shape(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "[" + ",".join(str(s) for s in shape) + "]"


def _show_plan(out: Output, plan: ReshardPlan, as_json: bool) -> None:
    if as_json:
        out.json(plan.to_json())
        return
    m = plan.mesh
    ids = m.device_ids
    id_text = f"{ids[0]}..{ids[-1]}" if list(ids) == list(range(ids[0], ids[0] + len(ids))) else ", ".join(map(str, ids))
    origin = {"--devices": "--devices", "--topology": "--topology", "host": f"this host's {m.platform} devices"}.get(
        m.origin, f"this job's {m.platform} devices")
    out.header(f"reshard plan: {esc(plan.source)} ({plan.source_format}) -> {esc(plan.destination)}", [
        ("mesh", f"{esc(m.describe())}: {plural(m.size, 'device')} ({origin}, ids {esc(id_text)})"),
        *([("devices", esc(m.source))] if m.source else []),  # learned without jax: from where, what was assumed
        ("processes", str(plan.process_count)),
        ("leaves", f"{plural(sum(lp.placement == 'mesh' for lp in plan.leaves), 'array')} on the mesh, "
                   f"{plural(sum(lp.placement == 'host' for lp in plan.leaves), 'host array')}, {plural(len(plan.values), 'value')}"),
    ])
    out.line()
    for lp in plan.leaves:
        head = f"[bold]{esc(lp.path)}[/bold] {lp.dtype}{_shape(lp.shape)}"
        if lp.error:
            out.line(f"{head}  [red]error[/red]: {esc(lp.error)}")
            continue
        if lp.placement == "host":
            out.line(f"{head}  host array, copied as it is (chunk {_shape(lp.chunk_shape)})")
            continue
        split = f", {lp.replicas} replicas split on dim {lp.split_dim}" if lp.split_dim is not None else (
            f", {lp.replicas} replicas" if lp.replicas > 1 else "")
        out.line(
            f"{head}  {esc(format_spec(lp.old_spec) if lp.old_spec is not None else lp.old)} -> [cyan]{esc(format_spec(lp.new_spec))}[/cyan] "
            f"({esc(lp.origin)})  shard {_shape(lp.shard_shape)}  chunk {_shape(lp.chunk_shape)}{split}  "
            f"{plural(lp.chunks, 'chunk')}"
        )
        for note in lp.notes:
            out.line(f"    [yellow]{esc(note)}[/yellow]")
    for path, reason in plan.skipped:
        out.line(f"[yellow]skipped[/yellow] {esc(path)}: {esc(reason)}")
    out.line()
    for i, load in enumerate(plan.processes):
        out.line(f"process {i}: {plural(load.chunks, 'chunk')}, read {human_bytes(load.bytes_read)} "
                 f"({plural(load.source_chunks, 'source chunk')}, each decoded once), "
                 f"write {human_bytes(load.bytes_written)}")
    largest = max((lp.source_chunk_bytes for lp in plan.leaves), default=0)
    streamed = sum(lp.streamed_chunks for lp in plan.leaves)
    out.line(f"memory budget {human_bytes(plan.memory)} (--memory); largest source chunk {human_bytes(largest)} decoded"
             + (f"; {plural(streamed, 'source chunk')} larger than the budget allows decoded as a stream"
                if streamed else ""))
    host = (f"; host arrays {human_bytes(plan.host_bytes)} (restored as numpy arrays, on no device; "
            "--host-arrays-to-mesh lays them out on the mesh)") if plan.host_arrays else ""
    out.line(f"per device after restore: {human_bytes(plan.device_bytes)}{host}")
    if plan.errors:
        out.line(f"[bold red]{plural(len(plan.errors), 'leaf spec')} cannot be laid out[/bold red]; nothing would be written")
