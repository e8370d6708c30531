"""Shallow checks of a safetensors file or directory: headers, index and file sizes; no tensor is read.

Every header is read and checked on its own (a broken one does not hide the
others): the 8-byte length against the file and the 100 MB cap, the JSON,
each entry's dtype, shape and data_offsets, the tensors tiling the data
section exactly, and the file long enough. Across files: the index's
weight_map against the headers (a file or tensor it names that is not there,
a tensor it does not name, a tensor in two files), total_size, stray
`.safetensors` files, sharded files without an index, and torch DCP
per-rank pieces (overlaps, gaps).
"""
from __future__ import annotations

from ...base.errors import CkptError, PathEscapeError, UnreadableFileError
from ...base.findings import FILE_CAUSES, Findings
from . import reader as st
from ...storage import Storage


def check_path(storage: Storage, findings: Findings, *, step: str | int | None = None, only: str | None = None) -> None:
    """`only`: check just that file of `storage` (not listed: its directory may hold anything); no steps."""
    top = [] if only is not None else storage.listdir()[1]
    top_set = set(top) if only is None else ({only} if storage.exists(only) else set())
    index: dict[str, str] | None = None
    total: int | None = None
    if only is not None:
        files = [only]
    else:
        if st.INDEX_FILE in top_set:
            try:
                index, total = st.read_index(storage)
            except PathEscapeError:
                raise
            except CkptError as exc:
                findings.error("bad-metadata", exc.message, file=st.INDEX_FILE)
            findings.count("index")
        if index is not None:
            files = sorted(set(index.values()))
            for name in sorted(f for f in top if f.endswith(st.SUFFIX) and f not in set(files)):
                findings.warning(
                    "stray-file", f"a .safetensors file that {st.INDEX_FILE} does not name (loaders ignore it)", file=name
                )
        else:
            files = sorted(f for f in top if f.endswith(st.SUFFIX))
            if st.INDEX_FILE not in top_set:
                _check_unindexed_set(files, findings)
    headers: dict[str, st.Header] = {}
    for name in files:
        if name not in top_set:
            why = "no such file" if only is not None else f"named in {st.INDEX_FILE} but does not exist"
            _file_finding(findings, "missing-file", why, name, index)
            continue
        try:
            header = st.read_header(storage, name)
        except st.HeaderError as exc:
            _file_finding(findings, exc.code, exc.message, name, index)
            continue
        except PathEscapeError:
            raise
        except UnreadableFileError as exc:  # (the file's own problem, not its header's)
            _file_finding(findings, "unreadable-file", exc.message, name, index)
            continue
        except CkptError as exc:
            findings.error("bad-metadata", exc.message, file=name)
            continue
        findings.count("files")
        findings.count("tensors", len(header.tensors))
        for p in header.problems:
            _add(findings, p, name)
        headers[name] = header
    if not headers:
        return
    # the cross-file checks, on the headers that could be read
    layout = st.Layout(files, headers, index, total, False, {}, [], [], [])
    try:
        st._collect_tensors(layout)
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=exc.where and exc.where.rsplit("/", 1)[-1])
        return
    for p in layout.problems:
        file = None
        if p.tensor is not None and index is not None:
            file = index.get(p.tensor)
        _add(findings, p, file, index_problem=index is not None and p.code in ("leaf-missing", "bad-metadata"))


def _file_finding(findings: Findings, code: str, message: str, name: str, index: dict[str, str] | None) -> None:
    """A file's own problem: one finding, naming the tensors the index places in it (none can be
    loaded: its header is not there whole), as a cut-short file's finding names its own."""
    held = sorted(t for t, f in (index or {}).items() if f == name)
    if code not in FILE_CAUSES or not held:
        findings.error(code, message, file=name)
        return
    for tensor in held:
        findings.file_problem(code, message, file=name, leaf=tensor)


def _add(findings: Findings, p: st.Problem, file: str | None, *, index_problem: bool = False) -> None:
    if index_problem and file is None:
        file = st.INDEX_FILE
    if p.tensors and file is not None and p.code in FILE_CAUSES and p.severity == "error":
        # the file's one finding, naming the tensors it takes
        for tensor in p.tensors:
            findings.file_problem(p.code, p.message, file=file, leaf=tensor)
        return
    add = findings.warning if p.severity == "warning" else findings.error
    add(p.code, p.message, leaf=p.tensor, file=file)


def _check_unindexed_set(files: list[str], findings: Findings) -> None:
    """Files named model-K-of-N with N > 1 need the index that says which tensor is where."""
    sharded = [f for f in files if (m := st.SHARD_FILE.match(f)) and int(m.group("n")) > 1 and not st.DCP_SHARD_FILE.match(f)]
    if sharded:
        findings.error(
            "missing-metadata",
            f"{len(sharded)} sharded files ({sharded[0]}, ...) but no {st.INDEX_FILE}: transformers cannot load them",
            file=st.INDEX_FILE,
        )
        expected = {int(m.group("n")) for f in sharded if (m := st.SHARD_FILE.match(f))}
        for n in expected:
            stem = st.SHARD_FILE.match(sharded[0]).group("stem")  # type: ignore[union-attr]
            for k in range(1, n + 1):
                name = f"{stem}-{k:05d}-of-{n:05d}{st.SUFFIX}"
                if name not in files:
                    findings.error("missing-file", f"shard {k} of {n} is missing", file=name)
