"""An object-store destination's life (gs://, s3://): who writes it, what a killed write leaves.

A standard GCS or S3 bucket has no rename, so a convert or reshard to DST writes its files in
place, and a run killed midway (SIGKILL, a dead endpoint) leaves them there. Four rules make that
safe, in the roles ops/destination.py's temporary directory plays on a local disk:

* The owner record goes first. Before anything else is written, the primary creates
  `DST/.ckpt-owner.json` (host, pid and its start time, boot id, wall-clock start, a run id, the
  format written, and the top-level name globs of what it writes: the format's OUTPUT_ENTRIES)
  with a precondition, so that exactly one writer gets it: GCS `ifGenerationMatch=0`, S3
  `If-None-Match: *` (tensorstore's `if_equal` = "no value"; its S3 driver sends the header only
  with `use_conditional_write`, set here for the record alone). A second writer fails at once,
  naming the first from its record, and touches nothing.
* The commit markers go last (each writer's commit(); the format names them: COMMIT_MARKERS),
  and the record is deleted after them. While the record is there, nothing at DST is a complete
  checkpoint: `validate` reports `incomplete-save` naming the run, whatever the files read as.
* `--overwrite` removes only what a record says its run wrote: the keys under its entries, the
  commit markers first and the record last (a removal killed midway is still a save of ckpt's,
  which the next run removes). Another object under DST (a user's notes.txt) is never deleted,
  and a prefix left holding one is refused, as a local directory holding other files is. A
  record whose run still writes (same host, its pid alive and started when recorded), or one
  from another host refreshed less than STALE_AFTER ago (a run refreshes its record every
  HEARTBEAT_EVERY seconds), is never taken over. Replacing a
  complete checkpoint deletes the keys listed when it was judged (its claimed files first), never
  a prefix-wide range.
* A run that fails (an error, Ctrl-C, SIGTERM) removes what it wrote and then its record (one
  process; a multi-process run leaves both, since its other processes may still be writing); a
  run that another took over (its record's generation changed) writes no commit marker and
  deletes nothing.

The core never prints: what was removed comes back as lines in OutputDir.notes.
"""
from __future__ import annotations

import fnmatch
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..base import strict_json
from ..base.errors import CkptError, DestinationExistsError, StorageUnavailableError
from .destination import (
    OWNER_FILE,
    OutputDir,
    Owner,
    Verdict,
    begin_output,  # noqa: F401 - (the engine's entry points, local ones passed through)
    discard_output as _discard_local,
    finalize_output as _finalize_local,
    judge_remote,
    prepare_output as _prepare_local,
)
from ..storage import Storage, _kvstore_spec

_DELETE_BATCH = 64  # deletes in flight at once
# a run refreshes its record's `updated` this often (seconds), so that a record written on another
# host counts as abandoned STALE_AFTER after its run stopped, not a day later (several hosts share
# one bucket: the rerun after a killed one is often started from another host)
HEARTBEAT_EVERY = 60.0
STALE_AFTER = 600.0
_SHOWN = 6


def _no_value() -> bytes:
    """tensorstore's generation meaning "no value" as its Python API spells it (the encoding of
    StorageGeneration::NoValue() changed between releases; a missing key's stamp carries it)."""
    global _NO_VALUE
    if _NO_VALUE is None:
        import tensorstore as ts

        store = ts.KvStore.open({"driver": "memory"}).result()
        _NO_VALUE = bytes(store.read("missing").result().stamp.generation)
    return _NO_VALUE


_NO_VALUE: bytes | None = None


# -- the owner record ------------------------------------------------------------------------


@dataclass
class Record:
    """A parsed owner record: who wrote, and what."""

    owner: Owner
    run: str
    format: str
    entries: tuple[str, ...]  # top-level name globs of what the run writes
    markers: tuple[str, ...]  # its commit markers (removed first)
    updated: float

    def describe(self) -> str:
        return f"{self.owner.describe()}, writing {self.format}, run {self.run[:8]}"

    def status(self) -> str:
        """"alive", "gone" (same host, not running), "elsewhere" or "abandoned" (another host)."""
        if self.owner.same_host():
            return "alive" if self.owner.alive() else "gone"
        return "abandoned" if time.time() - self.updated > STALE_AFTER else "elsewhere"

    def owns(self, key: str) -> bool:
        """Whether `key` (relative to DST) is under one of the run's entries (never the record)."""
        return key != OWNER_FILE and any(fnmatch.fnmatchcase(key.split("/", 1)[0], g) for g in self.entries)

    def is_marker(self, key: str) -> bool:
        return "/" not in key and any(fnmatch.fnmatchcase(key, g) for g in self.markers)


def parse_record(data: bytes) -> Record | None:
    """The record in an owner object's bytes, or None when they are not one of ckpt's."""
    try:
        doc = strict_json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    owner = Owner.from_json(doc)
    if owner is None:
        return None
    entries, markers = doc.get("writes"), doc.get("markers", [])
    run, fmt = doc.get("run"), doc.get("format")
    if (not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries)
            or not isinstance(markers, list) or not all(isinstance(m, str) for m in markers)
            or not isinstance(run, str) or not isinstance(fmt, str)):
        return None
    updated = doc.get("updated", owner.started)
    return Record(owner, run, fmt, tuple(entries), tuple(markers),
                  float(updated) if isinstance(updated, (int, float)) else owner.started)


def _new_record(destination: str, fmt: str) -> tuple[str, bytes]:
    """(run id, the bytes of this run's owner record)."""
    from .. import formats

    info = formats.get(fmt)
    module = info.writer_module()
    entries = module.OUTPUT_ENTRIES
    if entries is None:  # the format's own names: what --overwrite deletes of a local one too
        entries = (*info.claims, *info.parts)
    run = uuid.uuid4().hex
    doc = Owner.this_process().to_json(destination)
    doc.update({"run": run, "format": fmt, "writes": sorted(set(entries)),
                "markers": list(module.COMMIT_MARKERS), "updated": time.time()})
    return run, json.dumps(doc, indent=1).encode("utf-8")


class _OwnerObject:
    """DST/.ckpt-owner.json, read and written with generation preconditions."""

    def __init__(self, storage: Storage) -> None:
        from ..storage.backend import open_kvstore

        self.storage = storage
        spec = storage.backend.spec_for("")
        if spec.get("driver") == "s3":
            # without it tensorstore's S3 driver peeks with a HEAD and then PUTs unconditionally
            # (not atomic) on endpoints it does not know to take If-None-Match
            spec = {**spec, "use_conditional_write": True}
        self.where = f"{storage.url}/{OWNER_FILE}"
        self.kv = open_kvstore(spec, storage.url)

    def read(self) -> tuple[bytes | None, bytes]:
        """(the record's bytes or None when missing, its generation)."""
        res = self.storage.backend.wait(self.kv.read(OWNER_FILE), "cannot read", self.where)
        if res.state != "value":
            return None, _no_value()
        return bytes(res.value), bytes(res.stamp.generation)

    def write_if(self, data: bytes | None, generation: bytes) -> bytes | None:
        """Write (None: delete) the record if its generation is `generation` (_no_value(): if it
        is missing); the new generation, or None when the condition failed."""
        what = "cannot delete" if data is None else "cannot write"
        stamp = self.storage.backend.wait(self.kv.write(OWNER_FILE, data, if_equal=generation), what, self.where)
        new = bytes(stamp.generation)
        return new if new else None  # tensorstore: an empty generation is a failed condition


# -- the output -------------------------------------------------------------------------------


@dataclass
class RemoteOutput(OutputDir):
    """An object-store destination being written in place, and this run's hold on it."""

    run: str = ""
    record: bytes = b""
    generation: bytes | None = None  # our record's generation (the primary, while it holds it)
    parsed: Record | None = None
    shared: bool = False  # several processes write it (a failed run's keys then stay, with the record)
    # the heartbeat refreshing the record while the run writes (generation changes under the lock)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    stop: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    beat: threading.Thread | None = field(default=None, repr=False, compare=False)

    def start_heartbeat(self, owner: "_OwnerObject") -> None:
        """Refresh the record's `updated` every HEARTBEAT_EVERY seconds (conditionally on its
        generation: a record another run took over is left alone) until stop_heartbeat."""
        def run() -> None:
            while not self.stop.wait(HEARTBEAT_EVERY):
                with self.lock:
                    if self.generation is None:
                        return
                    doc = json.loads(self.record)
                    doc["updated"] = time.time()
                    data = json.dumps(doc, indent=1).encode("utf-8")
                    try:
                        new = owner.write_if(data, self.generation)
                    except CkptError:
                        continue  # a slow or dead endpoint: the run itself meets it
                    if new is None:  # taken over: confirm_output says so before any marker
                        return
                    self.record, self.generation = data, new

        self.beat = threading.Thread(target=run, name="ckpt-owner-heartbeat", daemon=True)
        self.beat.start()

    def stop_heartbeat(self) -> None:
        self.stop.set()
        if self.beat is not None and self.beat is not threading.current_thread():
            self.beat.join()


def is_remote(destination: str) -> bool:
    return _kvstore_spec(destination)[1] is None


def prepare_output(source: str, destination: str, *, overwrite: bool, shared_name: bool = False,
                   primary: bool = True, writes: str | None = None) -> OutputDir:
    """output.prepare_output, with an object-store DST claimed by its owner record (on the primary):
    refused while another run holds it, its leftovers removed under --overwrite. `writes`: the
    format written (what the record says the run writes)."""
    if not is_remote(destination) or writes is None:
        return _prepare_local(source, destination, overwrite=overwrite, shared_name=shared_name, primary=primary)
    out = RemoteOutput(destination, destination, None, shared=shared_name)
    if not primary:  # the primary claims DST for every process, before any of them writes
        return out
    storage = Storage.create(destination)
    out.run, out.record = _new_record(destination, writes)
    out.parsed = parse_record(out.record)
    owner = _OwnerObject(storage)
    keys = _listing(storage)
    if OWNER_FILE in keys:
        _take_over(out, storage, owner, overwrite=overwrite)
    elif keys:
        verdict = judge_remote(destination, storage, keys, source)
        verdict.require_replaceable(destination, overwrite=overwrite)
        # the record names the checkpoint's entries too: a replacement cut short (a dead endpoint)
        # leaves a record covering what is left of it
        _cover(out, tuple(_literal(p.rstrip("/")) for p in verdict.parts), ())
        _claim(out, owner)
        _delete_keys(storage, *_claimed_first([k for k in keys if k != OWNER_FILE]))
        out.notes.append(verdict.replaced(destination))
    else:
        _claim(out, owner)
    # the record is ours: anything else now under DST came from another run meanwhile
    rest = [k for k in _listing(storage) if k != OWNER_FILE]
    if rest:
        _release(out, owner)
        verdict = judge_remote(destination, storage, rest, source)
        if verdict.replaceable:
            raise DestinationExistsError("destination appeared while starting; another run wrote it first "
                                         "(use --overwrite to replace it)", destination)
        removed = f" ({out.notes[-1]})" if out.notes else ""
        raise DestinationExistsError(f"destination is {verdict.what}; refusing to write beside it{removed}",
                                     destination)
    out.start_heartbeat(owner)
    return out


def _claim(out: RemoteOutput, owner: _OwnerObject) -> None:
    """Create the record if no one has; a race lost is one line naming the winner."""
    gen = owner.write_if(out.record, _no_value())
    for _ in range(3):
        if gen is not None:
            break
        data, held = owner.read()
        if data is None:
            # the record that beat ours is gone already: its run finished (or gave up) between our
            # create and this read. Claim again; what that run left is judged once DST is ours
            gen = owner.write_if(out.record, _no_value())
            continue
        record = parse_record(data)
        if record is None or record.run != out.run:
            raise _busy(out.destination, record)
        # ours after all: a retried create whose first attempt the store had applied (its answer lost)
        gen = held
    if gen is None:  # records came and went three times over: a busy destination
        raise _busy(out.destination, None)
    out.generation = gen


def _busy(destination: str, record: Record | None) -> CkptError:
    if record is None:
        return CkptError(f"another ckpt run is starting to write this destination ({OWNER_FILE} is there)",
                         destination)
    where = "" if record.owner.same_host() else "; it runs on another host"
    return CkptError(f"another ckpt is writing this destination ({record.describe()}{where}); "
                     f"its record is {destination.rstrip('/')}/{OWNER_FILE}", destination)


def _take_over(out: RemoteOutput, storage: Storage, owner: _OwnerObject, *, overwrite: bool) -> None:
    """DST holds a record: refuse while its run may still write; under --overwrite, take the
    record over (conditionally: one run wins) and remove what that run wrote."""
    data, gen = owner.read()
    if data is None:  # its run finished (or removed it) just now: claim DST as if it were empty
        _claim(out, owner)
        return
    prior = parse_record(data)
    if prior is None:
        raise DestinationExistsError(
            f"destination holds {OWNER_FILE}, which is not a ckpt owner record; refusing to replace it", out.destination)
    status = prior.status()
    if status in ("alive", "elsewhere"):
        raise _busy(out.destination, prior)
    if not overwrite:
        raise DestinationExistsError(f"destination holds an incomplete save of ckpt's ({prior.describe()}, "
                                     f"{'no longer running' if status == 'gone' else 'abandoned'}); "
                                     "use --overwrite to remove it and write", out.destination)
    # this run's record names the old run's entries too: a removal cut short here (a dead endpoint)
    # leaves a record that still covers everything the old run wrote
    _cover(out, prior.entries, prior.markers)
    new = owner.write_if(out.record, gen)
    if new is None:  # another run took it over first
        data, _ = owner.read()
        raise _busy(out.destination, parse_record(data) if data else None)
    out.generation = new
    mine = [k for k in _listing(storage) if prior.owns(k)]
    _delete_keys(storage, [k for k in mine if prior.is_marker(k)], [k for k in mine if not prior.is_marker(k)])
    out.notes.append(f"removed the incomplete save of an interrupted ckpt run at {out.destination} "
                     f"({prior.describe()}): {len(mine)} object{'s' * (len(mine) != 1)}")


def _cover(out: RemoteOutput, entries: tuple[str, ...], markers: tuple[str, ...]) -> None:
    """Add `entries` and `markers` (name globs) to this run's record, before it is written."""
    doc = json.loads(out.record)
    doc["writes"] = sorted(set(doc["writes"]) | set(entries))
    doc["markers"] = sorted(set(doc["markers"]) | set(markers))
    out.record = json.dumps(doc, indent=1).encode("utf-8")
    out.parsed = parse_record(out.record)


def _literal(name: str) -> str:
    """A glob matching exactly `name` (fnmatch has no escape: its special characters as classes)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _listing(storage: Storage) -> list[str]:
    """Every key under the root now (one LIST; not Storage.list's remembered snapshot: the keys
    deleted here bypass it)."""
    return storage.backend.list_keys("")


def _claimed_first(keys: list[str]) -> tuple[list[str], list[str]]:
    """A checkpoint's keys in the order they are deleted: the top-level files a format claims
    (its metadata and commit markers) first, so that a removal killed midway never leaves the rest
    looking complete."""
    from .. import formats

    infos = formats.registered()
    first = [k for k in keys if "/" not in k and any(i.claimed(k) for i in infos)]
    chosen = set(first)
    return first, [k for k in keys if k not in chosen]


def _delete_keys(storage: Storage, *groups: list[str]) -> None:
    """Delete each group of keys (relative to the root), a batch in flight at a time, every key of
    a group gone before the next group's first delete starts (commit markers before the data)."""
    backend = storage.backend
    for keys in groups:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i:i + _DELETE_BATCH]
            futures = [(k, backend.kvstore.write(k, None)) for k in batch]
            for key, fut in futures:
                backend.wait(fut, "cannot delete", backend.where(key))


def _release(out: RemoteOutput, owner: _OwnerObject) -> bool:
    """Delete our record (if it is still ours); whether it was."""
    if out.generation is None:
        return False
    gen, out.generation = out.generation, None
    return owner.write_if(None, gen) is not None


def confirm_output(out: OutputDir) -> None:
    """Before the commit markers: this run still holds DST (no other run took its record over)."""
    if not isinstance(out, RemoteOutput) or out.generation is None:
        return
    out.stop_heartbeat()  # (the record's generation stays put from here on)
    owner = _OwnerObject(Storage.create(out.destination))
    data, gen = owner.read()
    if gen != out.generation:
        out.generation = None  # not ours any more: nothing here is this run's to delete
        record = parse_record(data) if data else None
        who = f" ({record.describe()})" if record is not None else ""
        raise CkptError(f"another ckpt run took this destination over{who}; this run wrote no commit marker",
                        out.destination)


def finalize_output(out: OutputDir, *, overwrite: bool) -> None:
    """output.finalize_output; an object store's output is complete once its markers are written:
    the record goes."""
    if not isinstance(out, RemoteOutput):
        _finalize_local(out, overwrite=overwrite)
        return
    out.stop_heartbeat()
    if out.generation is not None:
        _release(out, _OwnerObject(Storage.create(out.destination)))


def discard_output(out: OutputDir) -> None:
    """output.discard_output; on an object store, what this run wrote and then its record, if the
    record is still ours (best effort: an endpoint that stopped answering keeps them, and the
    record says what the next --overwrite removes)."""
    if not isinstance(out, RemoteOutput):
        _discard_local(out)
        return
    out.stop_heartbeat()
    if out.generation is None or out.parsed is None:
        return
    if out.shared:
        # other processes may still be writing (their failure reaches them later): what they
        # write after a removal here would be nobody's, so the record stays and says what the
        # next --overwrite removes
        return
    try:
        storage = Storage.create(out.destination)
        owner = _OwnerObject(storage)
        _, gen = owner.read()
        if gen != out.generation:
            out.generation = None
            return
        mine = [k for k in _listing(storage) if out.parsed.owns(k)]
        _delete_keys(storage, [k for k in mine if out.parsed.is_marker(k)],
                     [k for k in mine if not out.parsed.is_marker(k)])
        _release(out, owner)
    except (CkptError, StorageUnavailableError):
        pass


# -- what validate says of a record --------------------------------------------------------


def incomplete_save(storage: Storage) -> str | None:
    """validate's message when `storage`'s root holds an owner record (a save of ckpt's that has
    not finished: killed, failed where it could not clean up, or still writing); None otherwise."""
    try:
        # (an object store's listing is the one detection reads anyway: no request of its own)
        present = OWNER_FILE in storage.listdir()[1] if storage.local_root is None else storage.exists(OWNER_FILE)
        if not present:
            return None
        data = storage.read(OWNER_FILE)
    except StorageUnavailableError:
        raise
    except CkptError:
        return None
    record = parse_record(data)
    if record is None:
        return f"{OWNER_FILE} is here but is not a ckpt owner record: an incomplete save cannot be ruled out"
    state = {"alive": "still writing", "gone": "no longer running",
             "elsewhere": "on another host, cannot tell whether it still runs",
             "abandoned": f"on another host, not refreshed for over {STALE_AFTER / 60:g} min"}[record.status()]
    return (f"incomplete save of ckpt's: a convert/reshard ({record.describe()}; {state}) wrote here and has "
            f"not committed it; the next convert/reshard to this path with --overwrite removes what it wrote")


__all__ = ["RemoteOutput", "Record", "Verdict", "confirm_output", "discard_output", "finalize_output",
           "incomplete_save", "is_remote", "parse_record", "prepare_output"]
