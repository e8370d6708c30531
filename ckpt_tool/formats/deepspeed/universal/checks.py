"""Shallow checks of DeepSpeed universal checkpoints; --deep's CRC-32s (the ZeRO package's).

Shallow (no tensor data read): a root's `latest_universal` (garbage `bad-metadata`, a tag without
its directory `missing-file`), then each universal step: the model-states file(s) and
`zero/optimizer_state.pt` there (DeepSpeed's universal load asserts it: `missing-file`), every
file opened as a torch.save archive (`truncated-file`, `empty-file`, `bad-metadata`,
`unsafe-pickle`), for every parameter the model-states file says is trained its `fp32.pt`,
`exp_avg.pt` and `exp_avg_sq.pt` (`missing-file`: DeepSpeed reads each), each tensor's element
count against the recorded shape and its claim on its storage (`bad-metadata`, `missing-chunk`).
"""
from __future__ import annotations

import math
from typing import Any

from ....base.errors import CkptError, PathEscapeError, UsageError
from ....base.findings import Findings
from ....core.model import ArrayLeaf
from ....storage import Storage
from ....machinery.torch_save.safe_pickle import TensorRef
from .. import checks as dsc
from . import reader as u


def check_path(storage: Storage, findings: Findings, *, step: str | int | None = None, only: str | None = None) -> None:
    dirs, files = storage.listdir()
    if u.is_zero_listing(storage, dirs, files):
        raise u.zero_folder_error(storage)
    if u.is_step_listing(dirs, files):
        if step not in (None, "latest", "all"):
            raise UsageError(f"--step {step} given, but this is one step directory", storage.url)
        _check_step(storage, findings, "")
        return
    steps, tag, problem = u.list_steps(storage)
    dsc.check_tag_file(findings, files, u.LATEST, steps, tag, problem, "DeepSpeed's universal load",
                       "DeepSpeed's load_checkpoint(load_universal=True) needs it (or a tag)")
    complete = [s.name for s in steps if s.committed]
    if step in (None, "all"):
        chosen = complete
        if not chosen:
            findings.error("no-steps", "no universal step directory (zero/ beside a model-states file)", file=".")
    elif step == "latest":
        chosen = [tag] if tag in complete else []
        if not chosen and not findings.errors:
            findings.error("no-steps", f"no step directory for {u.LATEST}", file=".")
    else:
        name, _, _ = u.pick_step(storage, step)
        chosen = [name]
    for name in chosen:
        _check_step(storage.child(name), findings, f"{name}/")
    findings.count("steps", len(chosen))


def _check_step(storage: Storage, findings: Findings, prefix: str) -> None:
    try:
        models, has_optimizer, params, _ = u.scan(storage)
    except PathEscapeError:
        raise
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=prefix + ".")
        return
    names = [*models.values(), *([f"{u.ZERO}/{u.OPTIMIZER_STATE}"] if has_optimizer else []),
             *[path for keys in params.values() for path in keys.values()]]
    opened = {name: dsc._open(storage, name, findings, prefix) for name in names}
    if any(a is None for a in opened.values()):
        return  # the structure is checked over files that open
    try:
        step = u.open_step(storage)
        leaves, _ = u.step_leaves(step)
    except PathEscapeError:
        raise
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=prefix + dsc._file_of(storage, exc.where))
        return
    for path in step.problems:
        what = ("DeepSpeed's universal load reads the optimizer's global state there" if path.endswith(u.OPTIMIZER_STATE)
                else "a data-parallel rank's model states" if not path.startswith(u.ZERO + "/")
                else f"the model-states file records {path.split('/')[1]} as trained: DeepSpeed's universal load reads it")
        findings.error("missing-file", f"does not exist ({what})", file=prefix + path)
    claims = 0
    for leaf in leaves:
        if not isinstance(leaf, ArrayLeaf):
            continue
        claims += 1
        file = prefix + str(leaf.extra.get("file", "."))
        if leaf.unreadable:
            code = "missing-chunk" if "missing from the archive" in leaf.unreadable else "bad-metadata"
            findings.error(code, leaf.unreadable, leaf=leaf.path, file=file)
    for name, shape in step.shapes.items():
        for key in u.REQUIRED_STATES:
            if key not in step.files.get(name, {}):
                continue
            pf = u.param_file(step, name, key)
            if isinstance(pf.value, TensorRef) and math.prod(pf.value.size) != math.prod(shape):
                findings.error("bad-metadata", f"holds {math.prod(pf.value.size)} elements (shape {list(pf.value.size)}), "
                               f"but the model-states file records {name} as {list(shape)}",
                               file=prefix + step.files[name][key])
            elif not isinstance(pf.value, TensorRef):
                findings.error("bad-metadata", f"holds {type(pf.value).__name__}, not a tensor",
                               file=prefix + step.files[name][key])
    findings.count("tensors", claims)  # (files: counted as dsc._open opens each)


def check_deep(storage: Storage, ckpt: Any, findings: Findings, skip_leaves: set[str]) -> None:
    """--deep beyond the tensor reads: every storage member's CRC-32, every value decoded."""
    dsc.check_deep(storage, ckpt, findings, skip_leaves)



