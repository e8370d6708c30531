"""`ckpt convert SRC DST --to FORMAT` (a format with a writer): streaming, bounded memory, all or nothing."""
from __future__ import annotations

from contextlib import nullcontext

import click

from .. import formats
from ..core.casting import kept_phrase
from ..ops.engine import ConvertOptions, convert
from .helptext import formats_read, formats_written
from .opened import take as take_opened
from .progress import progress_for
from .options import may_join, memory_option, multihost_options, output_options, weights_option
from .render import Output, esc, human_bytes, human_rate, plural, process_note


# the formats it reads and writes come from the registry (helptext), so that the lists cannot go stale
@click.command("convert", help=(
    f"Convert the checkpoint at SRC (any format ckpt reads, detected: {formats_read()}) into DST in the format "
    f"--to names ({formats_written()}), chunk by chunk. DST appears only when complete; SRC is never written. "
    "Run the same command on every host to split the work."))
@click.argument("src")
@click.argument("dst")
@click.option("--to", "to", type=click.Choice(formats.writable()), required=True, help="Output format.")
@click.option("--select", multiple=True, metavar="GLOB", help="Keep only leaves whose '/'-joined keys or dotted names match, e.g. 'params/**' or 'model.layers.0.*' (repeatable; each must match a leaf).")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Drop leaves whose keys or dotted names match, e.g. 'opt_state/**' (repeatable; each must match a leaf).")
@click.option("--rename", multiple=True, metavar="REGEX=REPL", help="Rewrite '/'-joined keys (repeatable, applied in order).")
@click.option("--unstack", multiple=True, metavar="GLOB",
              help="Split a stacked axis into one leaf per index, the index key where '{i}' stands: "
                   "'decoder/layers/{i}/**' (axis 0; '{i:1}' for axis 1). Repeatable, in order; before --rename.")
@click.option("--like", metavar="HF_DIR",
              help="A Hugging Face model directory the output must match (tensor names, shapes, dtypes; every "
                   "difference listed, nothing written); its config and tokenizer files are copied beside it.")
@click.option("--force-like", is_flag=True, help="With --like: write even when the output does not match.")
@click.option("--optimizer-keys-like", metavar="CKPT",
              help="Key the optimizer state as CKPT's is (any checkpoint ckpt reads): by integer ids, as "
                   "torch.save(opt.state_dict()), or by parameter FQNs, as DCP's get_state_dict; the ids and FQNs "
                   "are paired through the two param_groups by position, as torch does. Refused when the groups "
                   "differ in count, size or order.")
@click.option("--dtype", help="Cast floating weights and optimizer moments to this dtype (e.g. bfloat16); step "
                               "counters and integer leaves stay as they are, and a model's config.json names the "
                               "new dtype. Never done without this flag.")
@click.option("--allow-overflow", is_flag=True,
              help="With --dtype: write the output even when values overflow the new dtype (they become inf, "
                   "or NaN in float8_e4m3fn); refused otherwise, naming the leaves.")
@click.option("--chunk-mb", type=click.FloatRange(min=0.000001), help="Cap the output chunk size (MiB).")
@click.option("--max-shard-size", metavar="SIZE",
              help="safetensors: bytes per file, e.g. 5GB (default, as transformers), 500MB, 2GiB.")
@output_options
@memory_option
@multihost_options
@weights_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def convert_command(
    src: str, dst: str, to: str, select: tuple[str, ...], exclude: tuple[str, ...], rename: tuple[str, ...],
    unstack: tuple[str, ...], like: str | None, force_like: bool, optimizer_keys_like: str | None, dtype: str | None, allow_overflow: bool, chunk_mb: float | None, max_shard_size: str | None, zarr3: bool, skip_unsupported: bool, overwrite: bool,
    step: str | None, workers: int, coordinator: str | None, num_processes: int | None,
    process_id: int | None, as_json: bool, memory: int, weights: str | None,
) -> None:
    opts = ConvertOptions(
        to=to, select=list(select), exclude=list(exclude), rename=list(rename), unstack=list(unstack), like=like, force_like=force_like, dtype=dtype,
        optimizer_keys_like=optimizer_keys_like,
        allow_overflow=allow_overflow,
        chunk_mb=chunk_mb, skip_unsupported=skip_unsupported, zarr3=zarr3, workers=workers,
        overwrite=overwrite, step=step, memory=memory,
        max_shard_size=_shard_size(max_shard_size, to), read_options={"weights": weights} if weights else {},
    )
    # the other processes (flags, JAX_*, torchrun or Slurm variables); None alone. It moves
    # sys.stdout away from fd 1 (gloo's chatter): before Output takes sys.stdout
    coord = None
    if may_join(coordinator, num_processes, process_id):
        from ..base.distributed import join

        coord = join(coordinator, num_processes, process_id)
    out = Output(json_mode=as_json)
    with coord or nullcontext(), progress_for(out, "converting") as progress:
        result = convert(src, dst, opts, progress=progress, coordinator=coord)
    opened = take_opened()  # the run root's step converted (--step, else the one its framework resumes from)
    if as_json:
        # the --json contract (docs/commands/): "ok" as the exit status says
        out.json({"ok": True, **result.to_json(), "opened": opened[0].to_json() if opened else None})
        return
    for o in opened:
        out.line(esc(o.line()))
    for line in result.cleanup:  # temporary outputs of killed runs beside DST: removed, or left and why
        out.line(f"[yellow]{esc(line)}[/yellow]")
    for path, reason in result.skipped:
        out.line(f"[yellow]skipped[/yellow] {esc(path)}: {esc(reason)}")
    for r in result.optimizer_keys:  # --optimizer-keys-like: what was re-keyed
        out.line(esc(r.line()))
    if result.dtype is not None:  # what --dtype cast, and what it kept (step counters, integers: core/casting.py)
        kept = kept_phrase((reason for _, _, reason in result.kept), result.dtype)
        as_is = " as it is" if len(result.kept) == 1 else " as they are"
        out.line(f"cast {plural(len(result.cast), 'floating leaf', 'floating leaves')} to {esc(result.dtype)}"
                 + (f"; kept {esc(kept)}{as_is}" if kept else ""))
    if result.overflow_line:  # --allow-overflow: written with its inf / NaN values
        out.line(f"[yellow]overflow[/yellow] {esc(result.overflow_line)} (written: --allow-overflow)")
    for file, field, was in result.config_dtype:  # so that from_pretrained loads the cast dtype
        out.line(f"set {esc(file)} {esc(field)} to {esc(result.dtype or '')} (was {esc(was)})")
    for line in result.like_differences:  # --force-like: written although the reference differs
        out.line(f"[yellow]differs from --like[/yellow] {esc(line)}")
    if result.companions:
        out.line(f"copied beside it: {esc(', '.join(result.companions))}")
    where = process_note(result.process_index, result.process_count)
    out.line(
        f"[bold green]converted[/bold green] {esc(src)} ({result.source_format}) -> {esc(dst)} ({result.target_format}){where}: "
        f"{plural(result.arrays, 'array')}, {plural(result.values, 'value')}, {plural(result.chunks, 'chunk')}, "
        f"{human_bytes(result.bytes)} in {result.seconds:.1f} s ({human_rate(result.bytes, result.seconds)})"
    )


def _shard_size(text: str | None, to: str) -> int | None:
    if text is None:
        return None
    takers = formats.taking("max_shard_size")
    if to not in takers:
        raise click.UsageError(f"--max-shard-size applies to --to {' / '.join(takers)} only")
    from ..base.sizes import parse_size

    return parse_size(text, "--max-shard-size", examples="5GB, 500MB, 2GiB")
