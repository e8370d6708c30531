"""Where a convert or reshard writes, and how that becomes the destination.

One job: the output directory's life. A local output is written into a
temporary directory beside DST, `.{name}.ckpt-tmp-XXXXXXXX`, and renamed into
place once complete (object stores have no rename: the commit markers written
last make the output a checkpoint there). Three rules keep that safe:

* Only a checkpoint is ever replaced. `--overwrite` replaces DST when ckpt
  recognises it as one checkpoint (any format it reads: the registry's
  detection) and every entry in it belongs to that checkpoint (what the
  format that recognised it says its checkpoints hold: formats.contents).
  An empty directory (people `mkdir` DST first) needs no --overwrite: the
  output is renamed onto it, and that rename fails if anything appeared in it
  meanwhile. A checkpoint beside anything else (a
  user's notes.txt, a logs/ directory) is refused naming those entries:
  ckpt never deletes what is not a checkpoint's, and merging a new output
  into a directory of other files would give up the atomic rename. A run
  root of several steps is refused too (replacing it would delete every
  step for one checkpoint). A regular file, a symlink, a directory holding
  anything else, the working directory, a home directory, a filesystem root
  or mount point, a version-controlled directory, SRC or an ancestor of it
  are refused with one line saying what DST is. The check runs when the run
  starts and again on the very directory moved aside at the end (DST may
  have changed while the run wrote), before anything is deleted; what was
  replaced comes back as a line in OutputDir.notes.
* A temporary output names its owner. The first file written into it is
  `.ckpt-owner.json` (host, pid, the pid's start time from /proc, boot id,
  wall-clock start). A later run to the same DST looks at the temporaries
  beside it: one whose owner is gone (same host, and its pid is dead, or
  alive but started at another time, or the machine rebooted since) is
  removed and reported; one whose owner is alive stops the run ("another ckpt
  is writing this destination"); one written on another host is left alone
  and reported, unless nothing under it changed for ABANDONED_AFTER seconds
  (a day), when it is removed as abandoned. Only directories with ckpt's name
  pattern AND a readable owner record are ever removed; one without a record
  (an older ckpt, or a run in its first instant) is left and reported. In a
  multi-host run every process shares one temporary name; the primary
  (process 0) creates it, owns it and alone looks at leftovers.
* Errors name DST. The temporary directory is an implementation detail: a
  read-only parent, a full disk or a failed rename is reported against the
  destination (and the path inside it), never the hidden name.

The core never prints: what happened to leftovers comes back as lines
(OutputDir.notes) that the commands render.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..base import strict_json
from ..base.errors import CkptError, DestinationExistsError
from ..formats import TMP_MARKER, Contents, names_single_file
from ..base.names import OWNER_FILE
from ..storage import Storage, _kvstore_spec

# a temporary output written on another host whose files have not changed for
# this long is abandoned (a run that long without writing a byte is gone)
ABANDONED_AFTER = 24 * 3600.0
# `.{base}.ckpt-tmp`, `.{base}.ckpt-tmp-1a2b3c4d`, `.{base}.ckpt-tmp-old-1a2b3c4d` (a replaced DST being removed)
_TEMP_NAME = re.compile(r"^\.(?P<base>.+)" + re.escape(TMP_MARKER) + r"(?:-old)?(?:-[0-9a-f]{8})?$")
# directories that hold a person's work, never a checkpoint's
_VCS_MARKERS = (".git", ".hg", ".svn")
_SHOWN_NAMES = 3
_OTHERS_SHOWN = 6  # entries named when a checkpoint shares DST with other entries
_REPLACED_SHOWN = 6


# -- who owns a temporary output ---------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _host_name() -> str:
    """This machine's name, as socket.gethostname() gives it (the kernel's node name), without
    importing socket: a command that writes to a local path has no other use for it."""
    return os.uname().nodename


def _boot_id() -> str | None:
    return _read_text("/proc/sys/kernel/random/boot_id")


def _machine_id() -> str | None:
    return _read_text("/etc/machine-id")


def _pid_stat(pid: int) -> tuple[str, int] | None:
    """The process's state (/proc/PID/stat field 3: R, S, D, Z, ...) and start time in clock ticks
    since boot (field 22), if readable."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after its last ')'
        fields = text[text.rindex(")") + 2 :].split()
        return fields[0], int(fields[19])
    except (ValueError, IndexError):
        return None


def _pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), if readable."""
    stat_ = _pid_stat(pid)
    return None if stat_ is None else stat_[1]


@dataclass(frozen=True)
class Owner:
    """The process that writes a temporary output."""

    host: str
    pid: int
    pid_start: int | None  # /proc start time (ticks since boot): tells a reused pid apart
    boot_id: str | None
    machine_id: str | None
    started: float  # wall clock, for people

    @classmethod
    def this_process(cls) -> "Owner":
        pid = os.getpid()
        return cls(_host_name(), pid, _pid_start(pid), _boot_id(), _machine_id(), time.time())

    def to_json(self, destination: str) -> dict[str, Any]:
        return {
            "tool": "ckpt", "destination": destination, "host": self.host, "pid": self.pid,
            "pid_start": self.pid_start, "boot_id": self.boot_id, "machine_id": self.machine_id,
            "started": self.started,
        }

    @classmethod
    def from_json(cls, data: Any) -> "Owner | None":
        if not isinstance(data, dict) or data.get("tool") != "ckpt":
            return None
        host, pid, started = data.get("host"), data.get("pid"), data.get("started")
        if not isinstance(host, str) or type(pid) is not int or not isinstance(started, (int, float)):
            return None
        pid_start = data.get("pid_start")
        boot, machine = data.get("boot_id"), data.get("machine_id")
        return cls(host, pid, pid_start if type(pid_start) is int else None,
                   boot if isinstance(boot, str) else None, machine if isinstance(machine, str) else None,
                   float(started))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on {self.host} since {when}"

    def same_host(self) -> bool:
        if self.host != _host_name():
            return False
        here = _machine_id()
        return self.machine_id is None or here is None or self.machine_id == here

    def alive(self) -> bool:
        """On this host: is the owner still running? (No /proc to compare start times: a live pid counts.)"""
        boot = _boot_id()
        if self.boot_id and boot and self.boot_id != boot:
            return False  # the machine rebooted since
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass  # EPERM: a process of another user has that pid
        stat_ = _pid_stat(self.pid)
        if stat_ is None:
            return True
        state, start = stat_
        if state in ("Z", "X"):
            # exited, not yet reaped: a killed owner whose parent died with it stays a zombie where
            # nothing reaps orphans (a container whose PID 1 is not an init), and answers signal 0
            return False
        return not (self.pid_start is not None and start != self.pid_start)


def read_owner(directory: str) -> Owner | None:
    """The owner record of a temporary output, or None (missing, unreadable, not ckpt's)."""
    path = os.path.join(directory, OWNER_FILE)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with open(path, encoding="utf-8") as fh:
            return Owner.from_json(strict_json.loads(fh.read(65536)))
    except (OSError, ValueError):
        return None


def _write_owner(directory: str, owner: Owner, destination: str) -> None:
    path = os.path.join(directory, OWNER_FILE)
    # Not fsynced: a crash before it reaches the disk leaves a temporary without a record, which
    # is never removed (UNOWNED), so losing it can only keep a directory, never delete one. An
    # fsync here took 0.2-0.45 s of every write on a TPU VM's sandboxed kernel (gVisor).
    with open(path, "x", encoding="utf-8") as fh:
        json.dump(owner.to_json(destination), fh)


# -- temporaries left beside a destination ------------------------------------------

GONE = "gone"  # same host, the owner no longer runs: removable
ALIVE = "alive"  # same host, the owner runs: another ckpt is writing
ELSEWHERE = "elsewhere"  # another host: cannot tell
ABANDONED = "abandoned"  # another host, nothing changed for ABANDONED_AFTER: removable
UNOWNED = "unowned"  # no owner record: never removed


@dataclass
class Temporary:
    """A directory named like a ckpt temporary output, and what became of its owner."""

    path: str
    owner: Owner | None
    status: str
    nbytes: int = 0

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def removable(self) -> bool:
        return self.status in (GONE, ABANDONED)

    def to_json(self) -> dict[str, Any]:
        """`ckpt ls --json`'s entry for a stale temporary output."""
        owner = self.owner
        return {"name": self.name, "path": self.path, "bytes": self.nbytes, "status": self.status,
                "owner": None if owner is None else {"host": owner.host, "pid": owner.pid, "started": owner.started},
                "remove": remove_command(self.path)}

    def why(self) -> str:
        """Why it is stale (or not), in words."""
        return {
            GONE: "no longer running", ALIVE: "still running",
            ELSEWHERE: "another host, cannot tell whether it still runs",
            ABANDONED: f"another host, unchanged for over {ABANDONED_AFTER / 3600:g} h",
            UNOWNED: "no owner record",
        }[self.status]

    def describe(self) -> str:
        if self.owner is None:
            return f"{self.name} (no owner record: an older ckpt, or a run just starting)"
        return f"{self.name} ({self.owner.describe()}, {self.why()}; {_size(self.nbytes)})"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} byte{'s' * (n != 1)}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _tree_stats(path: str) -> tuple[int, float]:
    """(bytes, newest mtime) of everything under `path` (symlinks not followed)."""
    total, newest = 0, 0.0
    stack = [path]
    while stack:
        top = stack.pop()
        try:
            st = os.lstat(top)
            newest = max(newest, st.st_mtime)
            with os.scandir(top) as it:
                for entry in it:
                    try:
                        est = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    newest = max(newest, est.st_mtime)
                    if stat.S_ISDIR(est.st_mode):
                        stack.append(entry.path)
                    else:
                        total += est.st_size
        except OSError:
            continue
    return total, newest


def examine(path: str) -> Temporary | None:
    """What a directory named like a ckpt temporary is; None if it is not one (a file, a symlink)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    owner = read_owner(path)
    nbytes, newest = _tree_stats(path)
    if owner is None:
        status = UNOWNED
    elif owner.same_host():
        status = ALIVE if owner.alive() else GONE
    else:
        status = ABANDONED if time.time() - newest > ABANDONED_AFTER else ELSEWHERE
    return Temporary(path, owner, status, nbytes)


def temporaries_in(directory: str, base: str | None = None) -> list[Temporary]:
    """The ckpt temporary outputs directly inside `directory` (of destination `base` only, if given)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        m = _TEMP_NAME.match(name)
        if m is None or (base is not None and m.group("base") != base):
            continue
        temp = examine(os.path.join(directory, name))
        if temp is not None:
            found.append(temp)
    return found


def stale_temporaries(directory: str) -> list[tuple[str, str]]:
    """(name, message) of each temporary output inside `directory` that no running ckpt owns,
    for `ckpt validate` (a run still writing, or one on another host not yet abandoned, is left out)."""
    found = []
    for t in temporaries_in(directory):
        if t.status in (ALIVE, ELSEWHERE):
            continue
        m = _TEMP_NAME.match(t.name)
        target = m.group("base") if m else "its destination"
        found.append((t.name, f"temporary output of an interrupted ckpt convert/reshard: {t.describe()}; "
                              f"the next convert or reshard to {target} removes it, or delete it"))
    return found


def stale_outputs(root: str) -> list[Temporary]:
    """The temporary outputs directly inside the directory `root` (a path or file:// URL) whose
    owner is gone (this host: its pid no longer runs; another host: unchanged for
    ABANDONED_AFTER), for `ckpt ls` to name with their sizes and the command that removes them.
    A live owner's, one on another host that may still run, and one without an owner record are
    not stale and are left out; so is everything on an object store (an output is written in
    place there, and its owner record is the step's own: `ckpt ls` shows it in-progress)."""
    from ..storage import local_path

    local = local_path(root)
    return [t for t in temporaries_in(local) if t.removable] if local is not None else []


def remove_command(path: str) -> str:
    """The shell command that removes the directory `path`, quoted for a POSIX shell whatever it holds."""
    return "rm -rf -- '" + path.replace("'", "'\\''") + "'"


def _listed(temps: list[Temporary]) -> str:
    shown = "; ".join(t.describe() for t in temps[:_SHOWN_NAMES])
    return shown + (f"; and {len(temps) - _SHOWN_NAMES} more" if len(temps) > _SHOWN_NAMES else "")


# -- what the destination holds ---------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """Whether an existing destination may be replaced, and what it is, in words."""

    replaceable: bool
    what: str  # "a checkpoint (orbax)", "a regular file (12 bytes)", ...
    parts: tuple[str, ...] = ()  # a replaceable checkpoint's top-level entries (what replacing it deletes)
    hint: str = ""  # what to do instead, where the refusal alone would not say
    # an empty local directory: written into without --overwrite (people `mkdir` DST first); the
    # rename onto it fails if anything appears there meanwhile, so nothing is ever replaced
    empty: bool = False

    def exists_error(self, destination: str) -> CkptError:
        """The error for an existing DST without --overwrite: the hint only where --overwrite would work."""
        if self.replaceable:
            return DestinationExistsError(f"destination exists: it is {self.what}; use --overwrite to replace it", destination)
        return DestinationExistsError(f"destination exists and is {self.what}; choose another destination", destination)

    def require_replaceable(self, destination: str, *, overwrite: bool) -> None:
        """Refuse an existing DST: without --overwrite (exists_error), or one not ours to replace (refusal).
        An empty directory needs no --overwrite."""
        if self.empty:
            return
        if not overwrite:
            raise self.exists_error(destination)
        if not self.replaceable:
            raise self.refusal(destination)

    def refusal(self, destination: str) -> CkptError:
        hint = f": {self.hint}" if self.hint else ""
        return DestinationExistsError(f"destination is {self.what}; refusing to replace it{hint}", destination)

    def replaced(self, destination: str) -> str:
        """The line saying what replacing DST deleted (OutputDir.notes)."""
        if not self.parts:
            return f"replaced {self.what} at {destination}"
        n = len(self.parts)
        return (f"replaced {self.what} at {destination}: {n} entr{'ies' if n != 1 else 'y'} "
                f"({_names_text(list(self.parts), _REPLACED_SHOWN)})")


def _is_within(inner: str, outer: str) -> bool:
    """`inner` is `outer` or inside it (real paths)."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _protected(real: str) -> str | None:
    """Why a local directory must never be replaced, if it is one of those."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        cwd = None
    homes = {os.path.realpath(h) for h in (os.environ.get("HOME"), os.path.expanduser("~")) if h}
    if cwd is not None and real == cwd:
        return "the working directory"
    if cwd is not None and _is_within(cwd, real):
        return "an ancestor of the working directory"
    for home in homes:
        if real == home:
            return "a home directory ($HOME)"
        if _is_within(home, real):
            return "an ancestor of a home directory ($HOME)"
    if real == os.sep or os.path.ismount(real):
        return "a filesystem root (a mount point)"
    return None


def _names_text(names: list[str], shown: int) -> str:
    return ", ".join(names[:shown]) + (f", and {len(names) - shown} more" if len(names) > shown else "")


def _entries_text(dirs: list[str], files: list[str], noun: str = "file", shown: int = _SHOWN_NAMES) -> str:
    parts = []
    if files:
        parts.append(f"{len(files)} {noun}{'s' * (len(files) != 1)}")
    if dirs:
        parts.append(f"{len(dirs)} director{'ies' if len(dirs) != 1 else 'y'}")
    names = sorted(files) + [d + "/" for d in sorted(dirs)]
    if shown == _SHOWN_NAMES:
        listed = ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
    else:
        listed = _names_text(names, shown)
    return f"{' and '.join(parts)} ({listed})"


def _recognised(url: str, names: list[str] | None = None) -> Contents | None:
    """What ckpt recognises at `url`: the checkpoint's format and which entries are its own
    (formats.contents: the registry's detection and the format's parts; metadata is not parsed)."""
    from ..formats import contents

    try:
        return contents(Storage.open(url), names)
    except Exception:  # noqa: BLE001 - anything a detector trips on: not a checkpoint it recognises
        return None


def _checkpoint_verdict(found: Contents, is_dir: Callable[[str], bool]) -> Verdict:
    """A recognised checkpoint: replaceable when all of it is the checkpoint's and it is one checkpoint."""
    fmt = found.format.name
    if found.steps:
        n = len(found.steps)
        return Verdict(False, f"a run root of {n} checkpoints ({found.run}: "
                              f"{_names_text([s + '/' if is_dir(s) else s for s in found.steps], _OTHERS_SHOWN)})",
                       hint="replacing it would delete every step; choose a new directory")
    if found.others:
        dirs = [n for n in found.others if is_dir(n)]
        files = [n for n in found.others if n not in dirs]
        return Verdict(False, f"a checkpoint ({fmt}) beside {_entries_text(dirs, files, shown=_OTHERS_SHOWN)} "
                              f"that {'are' if len(found.others) != 1 else 'is'} not part of it",
                       hint="ckpt deletes only a checkpoint's own files; move the others out, or choose another destination")
    return Verdict(True, f"a checkpoint ({fmt})", parts=tuple(d + "/" if is_dir(d) else d for d in found.parts))


def judge_local(path: str, source: str | None = None) -> Verdict | None:
    """What the local path `path` holds, and whether it may be replaced; None if nothing is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Verdict(False, f"a path that cannot be examined ({exc.strerror or exc})")
    if stat.S_ISLNK(st.st_mode):
        return Verdict(False, f"a symlink (to {os.readlink(path)}), not a checkpoint directory")
    if not stat.S_ISDIR(st.st_mode):
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "a special file (FIFO, device or socket)"
        if stat.S_ISREG(st.st_mode) and names_single_file(path):
            return Verdict(False, "a single-file checkpoint; ckpt writes a directory, never one file")
        size = f" ({_size(st.st_size)})" if stat.S_ISREG(st.st_mode) else ""
        return Verdict(False, f"{kind}{size}, not a checkpoint directory")
    real = os.path.realpath(path)
    if source is not None:
        src_real = os.path.realpath(source)
        if _is_within(src_real, real):
            return Verdict(False, "the source or an ancestor of it")
    why = _protected(real)
    if why is not None:
        return Verdict(False, why)
    try:
        names = os.listdir(path)
    except OSError as exc:
        return Verdict(False, f"a directory that cannot be listed ({exc.strerror or exc})")
    if not names:
        return Verdict(True, "an empty directory", empty=True)
    vcs = [n for n in _VCS_MARKERS if n in names]
    if vcs:
        return Verdict(False, f"a version-controlled directory ({vcs[0]})")

    def is_dir(name: str) -> bool:
        return os.path.isdir(os.path.join(path, name)) and not os.path.islink(os.path.join(path, name))

    # the directory's own listing: empty directories, links and special files count too
    found = _recognised(path, names)
    if found is not None:
        return _checkpoint_verdict(found, is_dir)
    dirs = [n for n in names if is_dir(n)]
    files = [n for n in names if n not in dirs]
    return Verdict(False, f"a directory holding {_entries_text(dirs, files)} that are not a checkpoint")


def _remote_key(url: str) -> tuple[str, str, str] | None:
    """(scheme, bucket, path/) of an object-store URL, else None."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() in ("", "file"):
        return None
    bucket, _, path = rest.partition("/")
    path = path.strip("/")
    return scheme.lower(), bucket, (path + "/") if path else ""


def judge_remote(destination: str, storage: Storage, keys: list[str], source: str | None = None) -> Verdict:
    """What a non-empty object-store prefix holds, and whether it may be replaced."""
    dst = _remote_key(destination)
    if dst is not None and not dst[2]:
        return Verdict(False, f"a whole bucket holding {len(keys)} object{'s' * (len(keys) != 1)}")
    src = _remote_key(source) if source else None
    if src is not None and dst is not None and src[:2] == dst[:2] and src[2].startswith(dst[2]):
        return Verdict(False, "the source or a prefix holding it")
    top = sorted({k.split("/", 1)[0] for k in keys if "/" not in k})
    dirs = sorted({k.split("/", 1)[0] for k in keys if "/" in k})
    found = _recognised(destination)
    if found is not None:
        return _checkpoint_verdict(found, set(dirs).__contains__)
    return Verdict(False, f"a prefix holding {_entries_text(dirs, top, 'object')} that are not a checkpoint")


# -- the output directory ---------------------------------------------------------


@dataclass
class OutputDir:
    """Where the writer writes, and how it becomes the destination."""

    destination: str
    write_url: str
    local_tmp: str | None  # local: the temporary directory renamed into place
    source: str | None = None  # local source path (never replaced, never an ancestor of DST)
    notes: list[str] = field(default_factory=list)  # what was done with leftovers, one line each

    def storage(self) -> Storage:
        return Storage.create(self.write_url)

    def name_destination(self, exc: BaseException) -> None:
        """Say DST where an error names the temporary directory (its files keep their place in DST)."""
        if self.local_tmp is None or not isinstance(exc, CkptError):
            return
        tmp = self.local_tmp.rstrip(os.sep)
        dst = self.destination.rstrip("/") or self.destination
        changed = False
        if exc.where and tmp in exc.where:
            exc.where = exc.where.replace(tmp, dst)
            changed = True
        if tmp in exc.message:
            exc.message = exc.message.replace(tmp, dst)
            changed = True
        if changed:
            exc.args = (f"{exc.where}: {exc.message}" if exc.where else exc.message,)


def _same_or_inside(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep)


def prepare_output(
    source: str, destination: str, *, overwrite: bool, shared_name: bool = False, primary: bool = True
) -> OutputDir:
    """Check DST (and, on the primary, the temporaries beside it); where to write.

    Nothing is created here except DST's parent directory; begin_output
    creates the temporary directory with its owner record.
    """
    _, src_local = _kvstore_spec(source)
    _, dst_local = _kvstore_spec(destination)
    if dst_local is None:
        return _prepare_remote(source, destination, overwrite=overwrite)
    if src_local is not None:
        src_real, dst_real = os.path.realpath(src_local), os.path.realpath(dst_local)
        if _is_within(dst_real, src_real):
            raise CkptError("destination is the source or inside it; the source is never written", destination)
        if _is_within(src_real, dst_real):
            raise CkptError(f"destination holds the source ({source}); refusing to write over it", destination)
    replacing: Verdict | None = None
    if os.path.lexists(dst_local):
        verdict = judge_local(dst_local, src_local)
        if verdict is not None:
            verdict.require_replaceable(destination, overwrite=overwrite)
            if not verdict.empty:  # (an empty directory is written into, not replaced: nothing to say)
                replacing = verdict
    parent = os.path.dirname(dst_local.rstrip(os.sep)) or "."
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise CkptError(f"cannot create the parent directory: {exc.strerror or exc}", destination) from None
    base = os.path.basename(dst_local.rstrip(os.sep))
    # several processes must agree on the name; a single process gets a unique one
    suffix = TMP_MARKER if shared_name else f"{TMP_MARKER}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(parent, f".{base}{suffix}")
    out = OutputDir(destination, tmp, tmp, src_local)
    if primary:
        _clear_leftovers(out, parent, base)
        if replacing is not None:
            # said now (a command's summary takes the notes when the run starts); finalize_output
            # checks DST again and corrects this line if what it replaces changed meanwhile
            out.notes.append(replacing.replaced(destination))
    return out


def _prepare_remote(source: str, destination: str, *, overwrite: bool) -> OutputDir:
    # object stores: no rename; the commit markers written last make it a checkpoint
    dst = Storage.create(destination)
    keys = dst.list()
    if keys:
        verdict = judge_remote(destination, dst, keys, source)
        verdict.require_replaceable(destination, overwrite=overwrite)
        for key in keys:  # the keys judged, one by one: never a prefix-wide delete (see ops/destination_remote.py)
            dst.delete(key)
        return OutputDir(destination, destination, None, notes=[verdict.replaced(destination)])
    return OutputDir(destination, destination, None)


def _clear_leftovers(out: OutputDir, parent: str, base: str) -> None:
    """Remove the temporaries of DST whose owner is gone; refuse if one's owner still writes."""
    assert out.local_tmp is not None
    temps = temporaries_in(parent, base)
    alive = [t for t in temps if t.status == ALIVE]
    if alive:
        owner = alive[0].owner
        assert owner is not None
        raise CkptError(f"another ckpt is writing this destination ({owner.describe()}; its temporary "
                        f"output is {alive[0].name})", out.destination)
    ours = next((t for t in temps if t.path == out.local_tmp), None)
    if ours is not None and not ours.removable:
        # a multi-host run's shared name is taken by a temporary this run may not remove
        raise CkptError(
            f"a temporary output of another ckpt run is in the way: {ours.describe()}; "
            f"remove {ours.path} if no ckpt is writing this destination", out.destination,
        )
    removed = []
    for t in temps:
        if t.removable:
            _remove_tree(t.path)
            if not os.path.lexists(t.path):
                removed.append(t)
    left = [t for t in temps if not t.removable]
    if removed:
        n = len(removed)
        total = f" ({_size(sum(t.nbytes for t in removed))} in all)" if n > 1 else ""
        out.notes.append(
            f"removed {n} temporary output{'s' * (n != 1)} of {'interrupted ckpt runs' if n > 1 else 'an interrupted ckpt run'} "
            f"beside {out.destination}{total}: {_listed(removed)}"
        )
    if left:
        n = len(left)
        out.notes.append(
            f"left {n} temporary output{'s' * (n != 1)} beside {out.destination}: {_listed(left)}; "
            f"remove {'it' if n == 1 else 'them'} if no ckpt is writing there"
        )


def begin_output(out: OutputDir) -> None:
    """Create the temporary directory, its owner record first (local outputs; the primary only)."""
    if out.local_tmp is None:
        return
    try:
        os.mkdir(out.local_tmp)  # the umask decides, as for any directory the user creates
    except FileExistsError:
        # a leftover this run may replace (prepare_output checked its owner); or a racing run's
        raise CkptError("another ckpt run is starting to write this destination", out.destination) from None
    except OSError as exc:
        raise CkptError(f"cannot create the output: {exc.strerror or exc}", out.destination) from None
    try:
        _write_owner(out.local_tmp, Owner.this_process(), out.destination)
    except OSError as exc:
        _remove_tree(out.local_tmp)
        raise CkptError(f"cannot write the output: {exc.strerror or exc}", out.destination) from None


def finalize_output(out: OutputDir, *, overwrite: bool) -> None:
    """Move the finished temporary directory into place (local outputs)."""
    if out.local_tmp is None:
        return
    _, dst = _kvstore_spec(out.destination)
    assert dst is not None
    # the record goes first: DST must not carry it, and a run looking meanwhile leaves an unowned one alone
    try:
        os.unlink(os.path.join(out.local_tmp, OWNER_FILE))
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CkptError(f"cannot move the output into place: {exc.strerror or exc}", out.destination) from None

    def appeared() -> CkptError:
        verdict = judge_local(dst, out.source)
        hint = "use --overwrite to replace it" if verdict is None or verdict.replaceable else \
            f"it is {verdict.what}"
        return DestinationExistsError(f"destination appeared while converting; another run wrote it first ({hint})",
                         out.destination)

    try:
        if os.path.lexists(dst):
            found = judge_local(dst, out.source)
            if found is not None and found.empty:
                # the empty directory DST was (or became): the rename replaces it atomically, and
                # fails (ENOTEMPTY) if a file appeared in it meanwhile
                os.rename(out.local_tmp, dst)
            elif not overwrite:
                raise appeared()
            else:
                _replace(out, dst)
        else:
            # a rename onto a directory that another run renamed into place
            # meanwhile fails (ENOTEMPTY/EEXIST): that run won, this output goes
            os.rename(out.local_tmp, dst)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
            raise appeared() from None
        raise CkptError(f"cannot move the output into place: {exc.strerror or exc}", out.destination) from None
    _fsync_dir(os.path.dirname(dst) or ".")


def _replace(out: OutputDir, dst: str) -> None:
    """--overwrite: move DST aside, check what was moved is replaceable, put the output there, delete the old."""
    assert out.local_tmp is not None
    verdict = judge_local(dst, out.source)
    if verdict is not None and not verdict.replaceable:
        raise verdict.refusal(out.destination)
    parent = os.path.dirname(dst.rstrip(os.sep)) or "."
    trash = os.path.join(parent, f".{os.path.basename(dst.rstrip(os.sep))}{TMP_MARKER}-old-{uuid.uuid4().hex[:8]}")
    os.rename(dst, trash)
    # what is deleted is exactly what was moved aside: check that, not what DST was a moment ago
    moved = judge_local(trash, out.source)
    if moved is not None and not moved.replaceable:
        try:
            os.rename(trash, dst)
        except OSError:
            pass
        raise CkptError(f"destination changed while converting: it is now {moved.what}; refusing to replace it",
                        out.destination)
    try:
        _write_owner(trash, Owner.this_process(), out.destination)  # so a run after a crash here may remove it
    except OSError:
        pass
    try:
        os.rename(out.local_tmp, dst)
    except OSError:
        try:
            os.rename(trash, dst)  # put the old one back
        except OSError:
            pass
        raise
    _remove_tree(trash)
    said = moved.replaced(out.destination) if moved is not None else None
    old = [i for i, line in enumerate(out.notes) if line.startswith("replaced ")]
    if said is not None and said not in out.notes:
        if old:
            out.notes[old[0]] = said
        else:
            out.notes.append(said)


def discard_output(out: OutputDir) -> None:
    """Remove an unfinished local output (object stores: nothing to remove; no commit marker was written)."""
    if out.local_tmp is not None:
        _remove_tree(out.local_tmp)


def _remove_tree(path: str) -> None:
    """A directory and what it holds, as far as it can be removed. (shutil, and with it bz2 and
    lzma, is imported here: only leftovers, a replaced DST and a failed run need it.)"""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
