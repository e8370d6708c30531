"""Shallow checks of DeepSpeed ZeRO checkpoints; --deep's CRC-32s.

Shallow (no tensor data read): a root's `latest` (a tag naming a step directory here: garbage is
`bad-metadata`, a tag without its directory `missing-file`), then each step checked (every step
by default, `--step N` / `latest` one): every model-states and optimizer-states file opened as a
torch.save archive (zip records, pickle through the allow-list: `truncated-file`, `empty-file`,
`bad-metadata`, `unsafe-pickle`), a data-parallel rank's file that is not there (`missing-file`,
naming the parameters it holds), the ranks agreeing on the stage and DP degree, the partitions'
lengths against the recorded shapes and padding (`bad-metadata`: the same sums zero_to_fp32
checks, and each parameter's elements inside the partitions), and every flat tensor's claim on
its storage (`missing-chunk`, `bad-metadata`). Pipeline steps: every stage's files and every layer
file opened, a missing layer / stage file `missing-file`; MoE: a missing expert file `missing-file`,
an expert file's tensors against the recorded experts (`bad-metadata`). Layouts ckpt does not read
yet (tensor-parallel ranks, MoE without ZeRO) are named (`bad-metadata`).

Deep (check_deep, after every parameter was read and checked for NaN/Inf): the CRC-32 of every
storage member of every file of the step (those no leaf reads too: a tied module's layer file, the
experts' module weights), each streamed once, and every recorded value decoded.
"""
from __future__ import annotations

from typing import Any

from ...base.errors import CkptError, NotFoundError, PathEscapeError, UnsafePickleError, UsageError
from ...base.findings import Findings
from ...core.model import ArrayLeaf
from ...storage import Storage
from ...machinery.torch_save.safe_pickle import UnsupportedTensorError
from ...machinery.torch_save import checks as tsc
from ...machinery.torch_save import reading as ts
from . import moe, opening
from . import reader as ds


def check_tag_file(findings: Findings, files: list[str], name: str, steps: list[Any], tag: str | None,
                   problem: str | None, loader: str, needs: str) -> None:
    """A root's tag file (`latest`, `latest_universal`): readable and naming a step directory that is
    there (`loader` fails on it otherwise); without one, `needs` says what a load lacks."""
    if name in files:
        if problem is not None:
            findings.error("bad-metadata", f"{name}: {problem}", file=name)
        elif tag not in [s.name for s in steps]:
            findings.error("missing-file", f"{name} names {tag!r}, which is not a step directory here "
                           f"({loader} fails on it)", file=name)
    elif steps:
        findings.warning("missing-metadata", f"no {name} file: {needs} to load any of these steps", file=".")


def check_path(storage: Storage, findings: Findings, *, step: str | int | None = None, only: str | None = None,
               weights: str = "fp32") -> None:
    """`weights`: the reader option (--weights) the reader opens with: the checks read what it would."""
    _, files = storage.listdir()
    if ds.is_step_listing(files):
        if step not in (None, "latest", "all"):
            raise UsageError(f"--step {step} given, but this is one step directory", storage.url)
        _check_step(storage, findings, "", weights)
        return
    steps, tag, problem = ds.list_steps(storage)
    check_tag_file(findings, files, ds.LATEST, steps, tag, problem, "DeepSpeed's load_checkpoint",
                   "DeepSpeed's load_checkpoint needs a tag")
    if step in (None, "all"):
        chosen = [s.name for s in steps]
    elif step == "latest":
        chosen = [tag] if tag in [s.name for s in steps] else []
        if not chosen and not findings.errors:
            findings.error("no-steps", "no step directory for latest", file=".")
    else:
        name, _, _ = ds.pick_step(storage, step)
        chosen = [name]
    if not chosen and step in (None, "all"):
        findings.error("no-steps", "no global_stepN directory holding model and optimizer states", file=".")
    for name in chosen:
        _check_step(storage.child(name), findings, f"{name}/", weights)
    findings.count("steps", len(chosen))


def _check_step(storage: Storage, findings: Findings, prefix: str, weights: str) -> None:
    files = ds.scan_step(storage)
    if files.refused:
        refusal = ds._refusal(files, storage.url)
        findings.error("bad-metadata", refusal.message if refusal else "not read", file=prefix + files.refused[0])
        return
    opened = [_open(storage, name, findings, prefix) for name in files.all_files()]
    if any(a is None for a in opened):
        return  # the structure is checked over files that open
    try:
        # --weights module: the module tensors' claims are checked (at stage 3 it is refused: a usage error)
        step, leaves, _ = opening.open_leaves(storage, weights)
    except (PathEscapeError, UsageError):
        raise
    except NotFoundError as exc:  # a pipeline stage's (or the) model-states file
        findings.error("missing-file", exc.message, file=prefix + (_named_file(exc.message) or "."))
        return
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=prefix + _file_of(storage, exc.where))
        return
    model_file = step.model_archives[0].name
    for name in step.missing_files:
        held = [leaf.name for leaf in leaves if isinstance(leaf, ArrayLeaf) and name in leaf.extra.get("files", [])]
        findings.error("missing-file", _missing_what(step, name)
                       + (f"; it holds part of {len(held)} tensors ({', '.join(held[:3])}"
                          + (" ..." if len(held) > 3 else "") + ")" if held else ""), file=prefix + name)
    moe.check_expert_files(step, leaves, findings, prefix)
    for problem in step.mapping.problems:
        findings.error("bad-metadata", f"partition lengths do not match the recorded shapes and padding: {problem}",
                       file=prefix + model_file)
    claims = 0
    gone = set(step.missing_files)  # (reported above: not again per tensor)
    for leaf in leaves:
        if not isinstance(leaf, ArrayLeaf):
            continue
        claims += 1
        if leaf.unreadable and not step.mapping.problems and not set(leaf.extra.get("files", [])) & gone:
            code = "missing-chunk" if "missing from the archive" in leaf.unreadable else "bad-metadata"
            findings.error(code, leaf.unreadable, leaf=leaf.path,
                           file=prefix + (leaf.extra.get("file") or (leaf.extra.get("files") or [model_file])[0]))
    findings.count("tensors", claims)


def _missing_what(step: Any, name: str) -> str:
    """What a missing file of a step was: a data-parallel rank's, a pipeline layer's, an expert's."""
    layer, expert = ds.PIPE_FILE.match(name), ds.EXPERT_FILE.match(name)
    if layer:
        return (f"pipeline layer file missing: layer {int(layer.group('layer'))}'s module state (its buffers and "
                "weights; DeepSpeed's load_state_dir reads it)")
    if expert:
        return (f"MoE expert file missing: expert {expert.group('expert')} of MoE layer {expert.group('layer')} "
                "(its module weights; DeepSpeed's load_checkpoint reads it)")
    optim = ds.OPTIM_FILE.match(name)
    stage = int(optim.group("mp")) if optim else 0
    return (f"rank file missing: the data-parallel degree is {step.world}"
            + (f" (pipeline stage {stage})" if step.files.layers else ""))


def _named_file(message: str) -> str | None:
    return next((w for w in message.split() if w.endswith(".pt")), None)


def _open(storage: Storage, name: str, findings: Findings, prefix: str) -> ts.Archive | None:
    """One archive opened as torch's reader would; its damage as a finding (None then)."""
    try:
        archive = ts.Archive(storage, name)
    except PathEscapeError:
        raise
    except UnsafePickleError as exc:
        findings.error("unsafe-pickle", f"refers to {exc.module}.{exc.name}: refused, nothing was executed",
                       file=prefix + name)
        return None
    except UnsupportedTensorError as exc:
        findings.error("bad-metadata", exc.message, file=prefix + name)
        return None
    except CkptError as exc:
        size = tsc.file_size(storage, name)
        code = "empty-file" if size == 0 else (
            "truncated-file" if any(part in exc.message for part in tsc.CUT_SHORT) else "bad-metadata")
        findings.error(code, exc.message, file=prefix + name)
        return None
    findings.count("files")
    return archive


def _file_of(storage: Storage, where: str | None) -> str:
    root = storage.url.rstrip("/") + "/"
    if where and where.startswith(root):
        return where[len(root):]
    return "."


def archives_of(ckpt: Any) -> list[ts.Archive]:
    """Every archive the checkpoint's leaves read from (model and optimizer states)."""
    found: dict[int, ts.Archive] = {}
    for leaf in ckpt.leaves:
        reader = getattr(leaf, "reader", None)
        inner = getattr(reader, "_inner", reader)
        archive = getattr(inner, "_archive", None)
        if isinstance(archive, ts.Archive):
            found[id(archive)] = archive
        for src in getattr(reader, "_sources", []):
            if src.archive is not None:
                found[id(src.archive)] = src.archive
    return list(found.values())


def check_deep(storage: Storage, ckpt: Any, findings: Findings, skip_leaves: set[str]) -> None:
    """--deep beyond the tensor reads: every storage member's CRC-32 in every file (those a whole
    read did not already check, each streamed once), every recorded value decoded."""
    prefix = f"{ckpt.layout['step_dir']}/" if ckpt.layout.get("step_dir") else ""
    archives = archives_of(ckpt)
    # the files no leaf reads from (pipeline layer files of weights only, MoE expert files): opened here
    step_storage = storage.child(ckpt.layout["step_dir"]) if ckpt.layout.get("step_dir") else storage
    read = {a.name for a in archives}
    for name in ds.scan_step(step_storage).all_files():
        if name not in read:
            try:
                archives.append(ts.Archive(step_storage, name))
            except PathEscapeError:
                raise
            except CkptError as exc:
                findings.error("bad-chunk", exc.message, file=prefix + name)
    tsc.verify_and_decode(findings, ckpt.leaves, skip_leaves,
                          archives=[(a, prefix + a.name) for a in sorted(archives, key=lambda a: a.name)],
                          value_file=lambda leaf, exc: prefix + str(leaf.extra.get("file")))
