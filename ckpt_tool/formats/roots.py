"""Run roots: the directories training frameworks save their steps into, one entry per framework.

A run root holds one directory (or file) per saved step, perhaps a pointer
file naming the newest finished one, and whatever an interrupted save left.
Each framework has its own rules for all three; `LAYOUTS` below holds them,
one `RunLayout` each: how a step entry is named (and its step number), what
the pointer file is and how it reads, and how a step that is still being
written (or was torn by a crash) looks, judged from a listing alone.
`ckpt ls` and `ckpt latest` (ckpt_tool/ops/runs.py) ask this table and never a
framework by name: a new framework's root layout is one more entry here.

Why one table in one module rather than an entry per format package: a run
root belongs to a training framework, not to a checkpoint format. torchtitan
saves DCP, the HF Trainer safetensors or torch.save files, verl torch.save
shards beside a Hugging Face config, NeMo 2 a Megatron-Core save under
`weights/`; one format (DCP) appears under several frameworks and one
framework (torchtitan) writes two formats. Where a format package already
knows a framework's rules (the Orbax reader's commit rules, the Megatron
reader's tracker, the DeepSpeed reader's `latest` tag, the msgpack reader's
temporary names), the package holds that framework's rules (its run_roots.py,
a contract.RunRules, named by its FormatInfo.run_roots) and the entry asks it
through the registry's table, handed in with the listing: nothing here imports
or names a format package.

Everything here works from one recursive LIST of the root (`RootListing`):
nothing is read but the pointer file, so a root of hundreds of steps on S3
costs a LIST and one small GET. The statuses:

  committed    complete by its writer's rule (the file the writer writes last is there)
  incomplete   named as a finished step, but what the writer writes last is missing
               (a save killed after the rename, or files deleted since)
  in-progress  what the writer names a save still being written (a temporary name, an
               unfinished marker, a step newer than the pointer the writer moves last)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..base import strict_json
from ..base.errors import CkptError, CorruptMetadataError
from ..base.text import is_ascii_number
# (the statuses, Entry and StepStatus are the contract's: a package's RunRules returns them)
from ..core.contract import COMMITTED, INCOMPLETE, IN_PROGRESS, STATUSES, Entry, RootView, RunRules, StepStatus  # noqa: F401

if TYPE_CHECKING:
    from ..storage import Storage
    from . import FormatInfo

MAX_POINTER_BYTES = 4096


@dataclass
class RootListing:
    """One LIST of a root: its top-level directories and files, and every key under each directory."""

    storage: Storage
    dirs: list[str]
    files: list[str]
    under: dict[str, list[str]]  # top-level directory -> its keys, relative to it
    # the registry's table (detection order): the packages holding a framework's rules (rules())
    formats: Sequence[FormatInfo] = ()
    # (entry, sub) -> top()'s answer, and entry -> its keys as a set: the layouts ask each many times
    _tops: dict[tuple[str, str], tuple[set[str], set[str]]] = field(default_factory=dict, repr=False)
    _keys: dict[str, set[str]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, storage: Storage, formats: Sequence[FormatInfo]) -> RootListing:
        """The root's one LIST; `formats`: the registry's table, for the layouts' rules."""
        under: dict[str, list[str]] = {}
        files: list[str] = []
        for key in storage.list():
            head, sep, rest = key.partition("/")
            if sep:
                under.setdefault(head, []).append(rest)
            else:
                files.append(key)
        if storage.local_root is not None:
            # a local directory with nothing in it is no key, yet it is an entry the frameworks see
            # (the HF Trainer's get_last_checkpoint takes a checkpoint-N/ its save made and was
            # killed before writing into); object stores have no empty directories
            import os

            try:
                with os.scandir(storage.local_root) as it:
                    for e in it:
                        if e.name not in under and e.is_dir(follow_symlinks=False):
                            under[e.name] = []
            except OSError:
                pass
        return cls(storage, sorted(under), files, under, formats)

    def top(self, entry: str, sub: str = "") -> tuple[set[str], set[str]]:
        """(directories, files) directly inside `entry` (or inside `entry/sub`)."""
        cached = self._tops.get((entry, sub))
        if cached is not None:
            return cached
        prefix = sub.rstrip("/") + "/" if sub else ""
        dirs: set[str] = set()
        files: set[str] = set()
        for key in self.under.get(entry, ()):
            if not key.startswith(prefix):
                continue
            head, sep, _ = key[len(prefix):].partition("/")
            (dirs if sep else files).add(head)
        self._tops[(entry, sub)] = (dirs, files)
        return dirs, files

    def has(self, entry: str, rel: str) -> bool:
        keys = self._keys.get(entry)
        if keys is None:
            keys = self._keys[entry] = set(self.under.get(entry, ()))
        return rel in keys

    def rules(self, layout: RunLayout) -> RunRules | None:
        """The layout's rules (rules_of, with this listing's registry table)."""
        return rules_of(layout, self.formats)


@dataclass(frozen=True)
class RunLayout:
    """One framework's run root: what `ckpt ls` and `ckpt latest` need to know about it."""

    name: str  # "torchtitan"
    title: str  # "torchtitan (DCP)"
    # the README's table (what the functions below implement, in words)
    named: str  # how a step entry is named: "step-N/"
    pointer_text: str  # the pointer file naming the latest, and how it reads
    in_progress: str  # how a save in progress (or torn) looks
    source: str  # where the rules come from (the writer's source; "documented layout")
    # its step entries' names, markers, statuses and pointer file's reading (contract.RunRules: step_of,
    # owns, status_of, confirm, read_pointer); None: a format package holds them (its FormatInfo.run_roots
    # names this layout), asked through the registry's table (rules_of)
    rules: RunRules | None = None
    # its steps are files (flax's checkpoint_N), not directories: entries of the other kind are not asked
    step_files: bool = False
    pointer: str | None = None  # the pointer file's name, at the root (its rules' read_pointer reads it)
    # a pointer that may name any entry (DeepSpeed's tag), not only one step_of recognises
    pointer_names_any: bool = False
    payload: str = ""  # the checkpoint inside a step directory, when it is not the directory itself
    fallback_format: str = ""  # the registry format of its steps when their file names do not say
    # the format's own reader opens the root with --step (its own step rules apply there)
    own_root: bool = False
    # newer steps than the pointer are saves in progress (the writer moves the pointer last)
    pointer_is_commit: bool = False
    # names that may be its entries: a cheap first filter, so that a root of one framework does not
    # import every other framework's reader (its rules' step_of decides; this only rules names out)
    hint: str = ""
    # whether the folder may be this framework's run root at all, from its top-level names (a
    # Hugging Face model folder is one model even with a Trainer's checkpoint-N/ beside it)
    claims_root: Callable[[RootListing], bool] = lambda listing: True
    # the step the framework's own resume opens, where that is not "what the pointer file names"
    # (pointer_is_commit) nor "the newest committed step": given the root's steps sorted by step
    # (objects with .name, .step, .status), the one it opens, or None (it finds nothing to resume);
    # a str instead: its resume fails before it opens a step, and why
    pick: Callable[[RootListing, Sequence[Any]], Any | None] | None = None
    # that rule in words, for the line saying which step the framework would pick and why
    resume: str = "the newest committed step"
    # how a launcher makes the framework open one given step instead (`ckpt latest` says it when the
    # step it prints is not the framework's own pick)
    explicit: str = ""


class _Rules(RunRules):
    """A framework's rules written here, where no format package knows them: its functions."""

    def __init__(self, step_of: Callable[[str], int | None], status_of: Callable[[RootListing, Entry], StepStatus], *,
                 owns: Callable[[RootListing, Entry], bool] | None = None,
                 confirm: Callable[[RootListing, Entry], StepStatus] | None = None,
                 read_pointer: Callable[[RootListing], str] | None = None) -> None:
        self._step_of, self._status_of, self._owns = step_of, status_of, owns
        self._confirm, self._read_pointer = confirm, read_pointer
        self.confirms = confirm is not None

    def step_of(self, name: str) -> int | None:
        return self._step_of(name)

    def owns(self, listing: RootView, entry: Entry) -> bool:
        assert isinstance(listing, RootListing)
        return self._owns(listing, entry) if self._owns is not None else True

    def status_of(self, listing: RootView, entry: Entry) -> StepStatus:
        assert isinstance(listing, RootListing)
        return self._status_of(listing, entry)

    def confirm(self, listing: RootView, entry: Entry) -> StepStatus:
        assert isinstance(listing, RootListing)
        return self._confirm(listing, entry) if self._confirm is not None else self._status_of(listing, entry)

    def read_pointer(self, listing: RootView) -> str:
        assert isinstance(listing, RootListing) and self._read_pointer is not None
        return self._read_pointer(listing)


# -- torchtitan step-N/ (DCP) ----------------------------------------------------------------------

_TITAN_STEP = re.compile(r"^step-(\d+)$")


def _titan_step(name: str) -> int | None:
    m = _TITAN_STEP.match(name)
    return int(m.group(1)) if m else None


def _titan_status(listing: RootListing, entry: Entry) -> StepStatus:
    _, files = listing.top(entry.name)
    # torchtitan's _find_load_step takes a step-N whose .metadata (DCP's, written last by the
    # coordinator) or model.safetensors.index.json (its HF export) is there
    if ".metadata" in files or "model.safetensors.index.json" in files:
        return StepStatus(COMMITTED)
    if any(f.endswith(".distcp") for f in files):
        return StepStatus(INCOMPLETE, "no .metadata: DCP writes it last, once every rank's .distcp is written")
    return StepStatus(INCOMPLETE, "no .metadata and no .distcp files")


# torchtitan's _find_load_step searches every name for `step-(\d+)` (not anchored) holding .metadata
# (or the HF index), takes the highest N, and opens `step-{N}`: a copy named `step-50.bak/` makes it
# pick 50, and fail when step-50/ is not there
_TITAN_ANY_STEP = re.compile(r"step-(\d+)")


def _titan_pick(listing: RootListing, rows: Sequence[Any]) -> Any | None:
    found: list[tuple[int, str]] = []
    for name in listing.dirs:
        m = _TITAN_ANY_STEP.search(name)
        if m is None:
            continue
        _, files = listing.top(name)
        if ".metadata" in files or "model.safetensors.index.json" in files:
            found.append((int(m.group(1)), name))
    if not found:
        return None
    n, name = max(found)
    row = next((r for r in rows if r.name == f"step-{n}"), None)
    if row is None:
        return (f"{name} holds .metadata, so torchtitan's _find_load_step takes step {n} and opens "
                f"step-{n}, which is not there")
    return row


# -- Hugging Face Trainer checkpoint-N/ ----------------------------------------------------------------

_HF_STEP = re.compile(r"^(tmp-)?checkpoint-(\d+)$")
HF_STATE = "trainer_state.json"


def _hf_step(name: str) -> int | None:
    m = _HF_STEP.match(name)
    return int(m.group(2)) if m else None


def _hf_owns(listing: RootListing, entry: Entry) -> bool:
    _, files = listing.top(entry.name)
    # not a Flax/T5X checkpoint_N (those use an underscore) nor anything without a model file; an
    # empty checkpoint-N/ is the Trainer's save killed before its first file (get_last_checkpoint takes it)
    return entry.name.startswith("tmp-") or not listing.under.get(entry.name) or HF_STATE in files or "config.json" in files or any(
        f.endswith((".safetensors", ".bin", ".safetensors.index.json")) for f in files)


# the weight files transformers' from_pretrained(folder) looks for at the folder's top level
_HF_TOP_WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".msgpack", ".h5")


def _hf_claims_root(listing: RootListing) -> bool:
    # config.json and weights at the top: from_pretrained(folder) loads that model and never looks
    # into checkpoint-N/ (Trainer.save_model() writes the final model beside its checkpoints)
    top = set(listing.files)
    return not ("config.json" in top and any(f.endswith(_HF_TOP_WEIGHTS) for f in top))


def _hf_pick(listing: RootListing, rows: Sequence[Any]) -> Any | None:
    # Trainer(resume_from_checkpoint=True) -> get_last_checkpoint: the highest `checkpoint-N`
    # directory (tmp-checkpoint-N does not match its pattern), whatever it holds
    named = [r for r in rows if r.step is not None and not r.name.startswith("tmp-")]
    return max(named, key=lambda r: r.step) if named else None


# trainer_state.json up to this size is parsed whole; a longer one is judged by its last bytes
_HF_STATE_PARSE = 1 << 20


def _hf_confirm(listing: RootListing, entry: Entry) -> StepStatus:
    """The listing's rule, then trainer_state.json read the way the Trainer's resume reads it
    (TrainerState.load_from_json: json.loads of the whole file): a save killed while writing it
    leaves it empty or cut short, and the resume fails on it (JSONDecodeError)."""
    status = _hf_status(listing, entry)
    if status.status != COMMITTED:
        return status
    import json

    name = f"{entry.name}/{HF_STATE}"
    try:
        # the torch.save files the resume torch.loads (optimizer.pt, scheduler.pt, rng_state[_R].pth,
        # training_args.bin): an empty one is a rank's save killed before its first byte (EOFError)
        _, files = listing.top(entry.name)
        for f in sorted(files):
            if f.endswith((".pt", ".pth", ".bin")) and listing.storage.size(f"{entry.name}/{f}") == 0:
                return StepStatus(INCOMPLETE, f"{f} is empty: the Trainer's resume torch.loads it (EOFError)")
        size = listing.storage.size(name)
        if size == 0:
            return StepStatus(INCOMPLETE, f"{HF_STATE} is empty: a save killed while writing it "
                                          "(the Trainer's resume fails on it: JSONDecodeError)")
        if size <= _HF_STATE_PARSE:
            doc = strict_json.loads(listing.storage.read(name).decode("utf-8"))
            if not isinstance(doc, dict):
                return StepStatus(INCOMPLETE, f"{HF_STATE} is not a JSON object (TrainerState cannot load it)")
        elif not listing.storage.read_range(name, size - 64, size).rstrip().endswith(b"}"):
            return StepStatus(INCOMPLETE, f"{HF_STATE} ends before its closing brace: a save killed while writing it")
    except (ValueError, UnicodeDecodeError) as exc:
        return StepStatus(INCOMPLETE, f"{HF_STATE} is not valid JSON ({str(exc)[:80]}): a save killed while "
                                      "writing it (the Trainer's resume fails on it: JSONDecodeError)")
    except CkptError as exc:
        return StepStatus(INCOMPLETE, f"{HF_STATE}: {exc.message}")
    return StepStatus(COMMITTED)


def _hf_status(listing: RootListing, entry: Entry) -> StepStatus:
    if entry.name.startswith("tmp-"):
        return StepStatus(IN_PROGRESS, "tmp-checkpoint-N: transformers 4.36's staged save, renamed when written")
    _, files = listing.top(entry.name)
    if HF_STATE not in files:
        return StepStatus(INCOMPLETE, f"no {HF_STATE}: the Trainer writes it last (after weights, optimizer, RNG)")
    if not any(f.endswith((".safetensors", ".bin")) for f in files):
        return StepStatus(INCOMPLETE, "no model weights (.safetensors / .bin)")
    return StepStatus(COMMITTED)


# -- NeMo 2 step directories (their names, markers and statuses: the Megatron package's run_roots) ----------

def _nemo_pick(listing: RootListing, rows: Sequence[Any]) -> Any | None:
    # AutoResume.nemo_path: the directories matching `*last`, less those with an `-unfinished`
    # marker beside them (_filter_out_unfinished_checkpoints); of several, the newest (by mtime
    # there, by step here); whether its files are complete is not asked
    last = [r for r in rows if r.name.endswith("last") and r.status != IN_PROGRESS]
    return max(last, key=lambda r: (r.step if r.step is not None else -1, r.name)) if last else None


# -- verl global_step_N/ + latest_checkpointed_iteration.txt ----------------------------------------------------

_VERL_STEP = re.compile(r"^global_step_(\d+)$")
_VERL_SHARD = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
VERL_TRACKER = "latest_checkpointed_iteration.txt"
VERL_DATA = "data.pt"
VERL_ROLES = ("actor", "critic")


def _verl_step(name: str) -> int | None:
    m = _VERL_STEP.match(name)
    return int(m.group(1)) if m else None


def _verl_status(listing: RootListing, entry: Entry) -> StepStatus:
    dirs, files = listing.top(entry.name)
    if "actor" not in dirs:
        return StepStatus(INCOMPLETE, "no actor/ directory")
    for role in (r for r in VERL_ROLES if r in dirs):
        sub_dirs, sub_files = listing.top(entry.name, role)
        if "dist_ckpt" in sub_dirs:  # the Megatron backend: a Megatron-Core save, metadata.json last
            if not listing.has(entry.name, f"{role}/dist_ckpt/metadata.json"):
                return StepStatus(INCOMPLETE, f"no {role}/dist_ckpt/metadata.json: Megatron writes it last")
            continue
        # the FSDP backend: every rank writes model_/optim_/extra_state_world_size_W_rank_R.pt
        shards = [m for f in sub_files if (m := _VERL_SHARD.match(f))]
        if not shards:
            return StepStatus(INCOMPLETE, f"no {role}/model_world_size_*_rank_*.pt files")
        world = int(shards[0].group(2))
        kinds = {m.group(1) for m in shards}
        have = {(m.group(1), int(m.group(3))) for m in shards if int(m.group(2)) == world}
        missing = [f"{k}_world_size_{world}_rank_{r}.pt" for k in sorted(kinds) for r in range(world) if (k, r) not in have]
        if missing:
            return StepStatus(INCOMPLETE, f"{role}/{missing[0]} missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if VERL_DATA not in files:
        # the trainer saves the dataloader state after the workers' checkpoints, then the tracker
        return StepStatus(INCOMPLETE, f"no {VERL_DATA}: verl's trainer writes it after the workers' files")
    return StepStatus(COMMITTED)


def _verl_pointer(listing: RootListing) -> str:
    where = f"{listing.storage.url}/{VERL_TRACKER}"
    if listing.storage.size(VERL_TRACKER) > MAX_POINTER_BYTES:
        raise CorruptMetadataError("not a step number", where)
    text = listing.storage.read(VERL_TRACKER).decode("utf-8", "replace").strip()
    # verl writes str(global_steps); find_latest_ckpt_path reads int(...) and opens global_step_{N}
    if not is_ascii_number(text):
        raise CorruptMetadataError(f"{text[:40]!r} is not a step number", where)
    return f"global_step_{int(text)}"


LAYOUTS: list[RunLayout] = [
    RunLayout(
        "orbax", "Orbax CheckpointManager",
        named="`N/` or `<prefix>_N/` (step_prefix)",
        pointer_text="none: the highest committed step",
        in_progress=("`N.orbax-checkpoint-tmp` (0.12; `-tmp-<n>` / `-tmp-<timestamp>` before), renamed at commit; "
                     "on gs:// the final name without `commit_success.txt` (the reader's commit rules per version)"),
        source="orbax-checkpoint atomicity.py / step.py (the Orbax reader's commit_status)",
        hint=r"\d", fallback_format="orbax", own_root=True,
        resume="CheckpointManager.latest_step(): the newest step orbax counts as committed, whatever its data holds",
        explicit="manager.restore(STEP)",
    ),
    RunLayout(
        "flax", "Flax checkpoint_N",
        named="`checkpoint_N` files (flax.training.checkpoints, orbax off)",
        pointer_text="none: the highest checkpoint_N (latest_checkpoint)",
        in_progress="`checkpoint_tmp` (flax writes it, then renames it to checkpoint_N)",
        source="flax/training/checkpoints.py",
        hint=r"^checkpoint", step_files=True, fallback_format="flax", own_root=True,
        resume="latest_checkpoint: the highest checkpoint_N, whatever it holds",
        explicit="restore_checkpoint(ckpt_dir, target, step=STEP)",
    ),
    RunLayout(
        "t5x", "T5X checkpoint_N/",
        named="`checkpoint_N/` holding the `checkpoint` msgpack file (also orbax <= 0.4's checkpoint_N/)",
        pointer_text="none: the highest checkpoint_N/ with its `checkpoint` file",
        in_progress="`checkpoint_N.tmp-<time>/` (renamed when written); a checkpoint_N/ without `checkpoint` is incomplete",
        source="t5x/checkpoints.py",
        hint=r"^checkpoint_", fallback_format="t5x", own_root=True,
        resume="latest_step: the highest checkpoint_N/ holding its `checkpoint` file",
        explicit="--restore_checkpoint_cfg.path=PATH",
    ),
    RunLayout(
        "torchtitan", "torchtitan (DCP)",
        named="`step-N/` under the job's checkpoint folder",
        pointer_text="none: the highest step-N/ holding `.metadata` (or an HF export's `model.safetensors.index.json`)",
        in_progress="a step-N/ without `.metadata` (DCP's coordinator writes it last, after every rank's `.distcp`)",
        source="torchtitan components/checkpoint.py (_find_load_step)",
        hint=r"^step-", rules=_Rules(_titan_step, _titan_status), fallback_format="dcp", pick=_titan_pick,
        resume="_find_load_step: the highest N of a directory named *step-N* holding `.metadata`, then step-N/ whatever it holds",
        explicit="--checkpoint.load_step STEP",
    ),
    RunLayout(
        "hf-trainer", "Hugging Face Trainer",
        named="`checkpoint-N/` (save_steps; weights as model.safetensors or pytorch_model.bin)",
        pointer_text="none: the highest checkpoint-N/ (get_last_checkpoint; it does not check completeness)",
        in_progress=("a checkpoint-N/ without `trainer_state.json` (written last, after weights, optimizer, "
                     "scheduler and RNG state); `tmp-checkpoint-N/` (transformers 4.36's staged saves)"),
        source="transformers trainer.py (_save_checkpoint), trainer_utils.py (get_last_checkpoint)",
        hint=r"checkpoint-", rules=_Rules(_hf_step, _hf_status, owns=_hf_owns, confirm=_hf_confirm), fallback_format="safetensors",
        claims_root=_hf_claims_root, pick=_hf_pick,
        resume="get_last_checkpoint: the highest checkpoint-N/, complete or not",
        explicit="trainer.train(resume_from_checkpoint=PATH)",
    ),
    RunLayout(
        "megatron", "Megatron-LM",
        named="`iter_NNNNNNN/` (7 digits; `release/`)",
        pointer_text="`latest_checkpointed_iteration.txt`: the iteration number (or `release`), written after the save",
        in_progress="an iter_N/ without `metadata.json` (written last by rank 0); an iter_N/ newer than the tracker",
        source="megatron/training/checkpointing.py (the Megatron reader's read_tracker)",
        hint=r"^(iter_|release$)", pointer="latest_checkpointed_iteration.txt",
        fallback_format="megatron", own_root=True, pointer_is_commit=True,
        resume="load_checkpoint: the iteration latest_checkpointed_iteration.txt names, complete or not",
        explicit="--ckpt-step STEP",
    ),
    RunLayout(
        "nemo2", "NeMo 2",
        named="`<name>--<metric>-step=N-consumed_samples=M/` (and its `-last` copy), each with `weights/` + `context/`",
        pointer_text="none: NeMo resumes from the newest finished `*-last` directory",
        in_progress="a `<name>-unfinished` marker file beside the directory (removed when the save is finalized)",
        source="NeMo nemo/lightning/pytorch/callbacks/model_checkpoint.py, nemo/lightning/resume.py",
        hint=r"step=", fallback_format="megatron",
        pick=_nemo_pick, resume="AutoResume: the newest `*-last` directory without an `-unfinished` marker, complete or not",
        explicit="AutoResume(resume_from_path=PATH), resume_if_exists off",
    ),
    RunLayout(
        "deepspeed", "DeepSpeed",
        named="`global_stepN/` (the default tag; any tag name works)",
        pointer_text="`latest`: the tag (a directory name), written after every rank's files",
        in_progress="a tag directory without model/optimizer states files; a step newer than `latest`",
        source="deepspeed/runtime/engine.py (save_checkpoint; the DeepSpeed reader's read_latest)",
        hint=r"^global_step\d", pointer="latest",
        pointer_names_any=True, fallback_format="deepspeed", own_root=True, pointer_is_commit=True,
        resume="load_checkpoint: the tag `latest` names, complete or not",
        explicit="engine.load_checkpoint(dir, tag=NAME)",
    ),
    RunLayout(
        "verl", "verl",
        named="`global_step_N/` holding `actor/` (and `critic/`), `data.pt`",
        pointer_text="`latest_checkpointed_iteration.txt`: the step number, written after the step's files",
        in_progress=("a global_step_N/ without `data.pt` or missing a rank's model/optim/extra_state file; "
                     "a step newer than the tracker (with async_save verl writes no tracker)"),
        source="verl trainer/ppo/ray_trainer.py (_save_checkpoint), utils/checkpoint/ (documented layout)",
        hint=r"^global_step_", rules=_Rules(_verl_step, _verl_status, read_pointer=_verl_pointer), pointer=VERL_TRACKER,
        payload="actor", fallback_format="torch", pointer_is_commit=True,
        resume="find_latest_ckpt_path: the step latest_checkpointed_iteration.txt names, complete or not",
        explicit="trainer.resume_mode=resume_path trainer.resume_from_path=PATH",
    ),
]


def layout_named(name: str) -> RunLayout:
    return next(layout for layout in LAYOUTS if layout.name == name)


def rules_of(layout: RunLayout, formats: Sequence[FormatInfo]) -> RunRules | None:
    """The layout's rules: its own, else those of the format package (in `formats`, the registry's
    table) whose FormatInfo.run_roots names it, imported now; None when no package in `formats` does
    (a registry without that format: the layout is not asked)."""
    if layout.rules is not None:
        return layout.rules
    info = next((f for f in formats if layout.name in f.run_roots), None)
    return info.rules_for(layout.name) if info is not None else None


def candidates(layout: RunLayout, dirs: Sequence[str], files: Sequence[str]) -> list[str]:
    """The names among a root's top-level entries that may be the layout's steps: of its kind (directories,
    or files where its steps are files) and passing its hint. Only these are asked of its rules (whose
    package, where a format package holds them, is imported then)."""
    return [n for n in (files if layout.step_files else dirs) if not layout.hint or re.search(layout.hint, n)]


def entries_of(listing: RootListing, layout: RunLayout) -> list[tuple[Entry, int | None]]:
    """The root's entries this layout claims, with their step numbers (None: flax's checkpoint_tmp)."""
    out: list[tuple[Entry, int | None]] = []
    names = candidates(layout, listing.dirs, listing.files)
    rules = listing.rules(layout) if names else None  # (no candidate: its rules are not loaded)
    if rules is None:
        return out
    for name in names:
        step = rules.step_of(name)
        if step is not None and (entry := Entry(name, not layout.step_files)) and rules.owns(listing, entry):
            out.append((entry, None if step < 0 else step))
    return out


def identify(listing: RootListing) -> tuple[RunLayout, list[tuple[Entry, int | None]]] | None:
    """The layout claiming most of the root's entries (ties: the table's order), or None."""
    best: tuple[float, int, RunLayout, list] | None = None
    for order, layout in enumerate(LAYOUTS):
        if not layout.claims_root(listing):
            continue
        found = entries_of(listing, layout)
        score = len(found) + (0.5 if layout.pointer and layout.pointer in listing.files else 0)
        if score and (best is None or score > best[0]):
            best = (score, order, layout, found)
    return (best[2], best[3]) if best else None


def format_of(listing: RootListing, layout: RunLayout, entry: Entry, formats: Sequence[FormatInfo]) -> str:
    """The registry format of a step, from the names in it (a listing): the first of `formats` (the
    registry's, in detection order) claiming one of its top-level names, else the layout's fallback."""
    if not entry.is_dir:
        return layout.fallback_format
    dirs, files = listing.top(entry.name, layout.payload)
    names = sorted(files) + sorted(dirs)
    if not any(info.claimed(n) for info in formats for n in names):
        # a step of named items (orbax <= 0.4's <item>/checkpoint): what the items hold
        below = f"{layout.payload}/" if layout.payload else ""
        names = sorted({k.rsplit("/", 1)[-1] for k in listing.under.get(entry.name, ())
                        if k.startswith(below) and k[len(below):].count("/") == 1})
    for info in formats:
        if any(info.claimed(n) for n in names):
            # a format of several families (msgpack: flax, t5x) says the layout's family
            return layout.fallback_format if layout.fallback_format in info.families else info.name
    return layout.fallback_format


def read_pointer(listing: RootListing, layout: RunLayout) -> tuple[str | None, str | None]:
    """(the entry name the pointer file names, None) or (None, what is wrong with it); (None, None)
    when the layout has no pointer file or it is absent."""
    rules = listing.rules(layout)
    if layout.pointer is None or rules is None or layout.pointer not in listing.files:
        return None, None
    try:
        return rules.read_pointer(listing), None
    except CkptError as exc:
        return None, exc.message
