"""Options several commands share."""
from __future__ import annotations

import os
from typing import Callable

import click

from ..base.parallel import copy_workers
from .main import PROCESS_VARIABLES

# base/distributed.py's choice of library (CHOICE_VARIABLE): a wrong value is refused even alone
DISTRIBUTED_CHOICE_VARIABLE = "CKPT_DISTRIBUTED"


def multihost_options(command: Callable) -> Callable:
    """--coordinator / --num-processes / --process-id, as jax.distributed.initialize takes them.

    Under torchrun or srun none is needed (base/distributed.py reads their variables); a flag wins.
    """
    for option in reversed([
        click.option("--coordinator", help="Multi-host: coordinator address host:port (or JAX_COORDINATOR_ADDRESS; "
                                           "torchrun's and srun's variables are read without flags)."),
        click.option("--num-processes", type=click.IntRange(min=1), help="Multi-host: number of processes (or JAX_NUM_PROCESSES)."),
        click.option("--process-id", type=click.IntRange(min=0), help="Multi-host: this process's id (or JAX_PROCESS_ID)."),
    ]):
        command = option(command)
    return command


def may_join(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Whether this command may be one of several processes: a multi-host flag, or a variable
    base/distributed.process_spec reads. Without any, that module (~900 lines, not needed by a
    one-process run) is not imported: process_spec would find a single process."""
    return (coordinator is not None or num_processes is not None or process_id is not None
            or any(v in os.environ for v in (*PROCESS_VARIABLES, DISTRIBUTED_CHOICE_VARIABLE)))


def output_options(command: Callable) -> Callable:
    """What convert and reshard share about writing the output."""
    for option in reversed([
        click.option("--zarr3", is_flag=True, help="Orbax output with zarr v3 instead of v2."),
        click.option("--skip-unsupported", is_flag=True, help="Report and skip leaves the target format cannot hold."),
        click.option("--overwrite", is_flag=True,
                     help="Replace an existing DST if it is a checkpoint (nothing else is ever replaced; an empty directory needs no --overwrite)."),
        click.option("--step", metavar="STEP", help="Source run root (any framework `ckpt ls` lists): a step number, a step's name or 'latest'."),
        click.option("--workers", type=click.IntRange(min=1), default=copy_workers, show_default="2 x cores up to 8, then cores, at most 16", help="Parallel chunk copies."),
    ]):
        command = option(command)
    return command


def weights_option(command: Callable) -> Callable:
    """--weights fp32|module: a reader option (formats.read_options) of the formats that take it."""
    from .. import formats

    return click.option(
        "--weights", type=click.Choice(["fp32", "module"]),
        help=f"{formats.joined(formats.reading('weights'))}: the consolidated fp32 master weights (default) or "
             "the module weights the model-states file holds, in the training dtype.",
    )(command)


def memory_option(command: Callable) -> Callable:
    """--memory SIZE: the read scheduler's budget (ckpt_tool/scheduler/admission.py)."""
    from ..base.memory import default_memory, parse_memory  # (not the scheduler, nor its numpy)

    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> int:
        if value is None:
            return default_memory()
        try:
            return parse_memory(value)
        except Exception as exc:  # CkptError: a usage error, one line
            # click names the option itself
            message = getattr(exc, "message", str(exc))
            raise click.BadParameter(message.removeprefix("--memory: ").removeprefix("--memory ")) from None

    return click.option(
        "--memory", metavar="SIZE", callback=convert,
        help="Memory budget for decoded chunks, assembly and write-behind, e.g. 512MiB, 4GiB. "
             "Stored chunks larger than it are decoded as a stream. Default: 512MiB, or 128MiB per "
             "copy worker on hosts of more cores (at most 2GiB and an eighth of the machine's memory).",
    )(command)
