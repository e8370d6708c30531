"""The long fuzzing run behind `make fuzz`.

    .venv/bin/python fuzz/run_fuzz.py --mutants 5000 --seed 1 --jobs 2 --out build/fuzz

Builds N mutants of the committed fixtures (each format's fixtures and share of the run: the FUZZ
rows and FUZZ_WEIGHT of its catalogue file, tests/conformance/formats/; --formats torch for one), runs `ckpt inspect --json`, `ckpt validate`
and `ckpt validate --deep` on each as whole processes, checks the contract
(tests/fuzz_lib.py) and the library oracle (tests/fuzz_oracle.py), plus every
explicit case (hostile pickles, path tricks, FIFOs, memory bombs) once, and --run-roots
mutants of the run roots (pointer and tracker files, step-named entries beside the steps),
run through inspect, validate, ls and latest of the root.

Writes DIR/summary.json (rewritten as the run goes, so an interrupted run
still has figures; it keeps the largest peak RSS per input-size band), DIR/rss_by_input.jsonl
(every run's peak RSS against the bytes it was given and the damaged file's size) and, for every failing mutant, DIR/failures/<class>/<id>/
holding the mutant checkpoint and outcome.json (its runs, stderr and the
oracle's answer): `ckpt validate --deep DIR/failures/<class>/<id>/<fixture>`
reproduces it. A torch.save mutant naming a global ckpt admits whose real class the
oracle cannot import (deepspeed, megatron) is counted under `oracle_unchecked`, not
checked. Mutant i of seed S is the same on every run of this code.
Exit status: 0 when no contract violation was found, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fuzz_lib as F  # noqa: E402


def _signature(cls: str, detail: str) -> str:
    """A violation's detail with paths, numbers and names blurred, to group
    the same failure across mutants."""
    s = re.sub(r"/tmp/\S+|/work/\S+", "<path>", detail)
    s = re.sub(r"\b[0-9a-f]{16,}\b", "<hex>", s)
    s = re.sub(r"\d+", "N", s)
    s = re.sub(r"'[^']*'", "'<s>'", s)
    return f"{cls}: {s[:160]}"


class Summary:
    def __init__(self, args: argparse.Namespace) -> None:
        self.lock = threading.Lock()
        self.args = args
        self.t0 = time.monotonic()
        self.mutants = 0
        self.runs = 0
        self.explicit = 0
        self.by_format: Counter = Counter()
        self.by_kind: Counter = Counter()
        self.exit_codes: dict[str, Counter] = defaultdict(Counter)
        self.oracle_checked = 0
        self.oracle_seconds = 0.0
        # torch.save mutants naming a global ckpt admits that the oracle cannot import (no verdict)
        self.oracle_unchecked = 0
        self.unchecked_globals: Counter = Counter()
        self.unchecked_examples: list[str] = []
        self.unconfirmed = 0
        self.classes: Counter = Counter()
        self.signatures: dict[str, dict] = {}
        self.slowest: dict | None = None
        self.max_rss: dict | None = None
        self.by_format_peaks: dict[str, dict] = {}  # format -> its own slowest run and peak RSS
        # peak RSS against input size: every run's (input bytes, damaged file bytes, RSS) goes to
        # DIR/rss_by_input.jsonl; the summary keeps the largest RSS per input-size band
        self.rss_log = args.out / "rss_by_input.jsonl"
        self.rss_log.unlink(missing_ok=True)
        self.rss_by_band: dict[str, dict] = {}
        self.failing = 0
        # what was measured: the tree at the start (the zygote imports it once)
        import subprocess

        def git(*a: str) -> str:
            try:
                return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
            except Exception:  # noqa: BLE001 - not a git checkout
                return ""
        self.commit = git("rev-parse", "HEAD").strip()
        self.dirty = [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()]

    def add(self, ident: str, outcome: F.Outcome, unconfirmed: list[str], saved: str | None) -> None:
        m = outcome.mutant
        with self.lock:
            if m.kind in ("hostile-pickle", "path", "bomb"):
                self.explicit += 1
            else:
                self.mutants += 1
            self.by_format[m.format] += 1
            self.by_kind[f"{m.format}:{m.kind}"] += 1
            self.unconfirmed += len(unconfirmed)
            peaks = self.by_format_peaks.setdefault(m.format, {"slowest": None, "max_rss": None})
            input_bytes, target_bytes = _input_sizes(m)
            band = _band(input_bytes)
            with self.rss_log.open("a") as log:
                for c, r in outcome.runs.items():
                    log.write(json.dumps({"id": ident, "format": m.format, "kind": m.kind, "command": c,
                                          "input_bytes": input_bytes, "target_bytes": target_bytes,
                                          "rss_mb": None if r.rss_kb is None else round(r.rss_kb / 1024, 1),
                                          "seconds": round(r.seconds, 3), "mutation": m.description[:120]}) + "\n")
                    if r.rss_kb:
                        top = self.rss_by_band.get(band)
                        if top is None or r.rss_kb / 1024 > top["rss_mb"]:
                            self.rss_by_band[band] = {"rss_mb": round(r.rss_kb / 1024, 1), "input_bytes": input_bytes,
                                                      "target_bytes": target_bytes, "id": ident, "command": c,
                                                      "mutant": m.label()[:160]}
            for c, r in outcome.runs.items():
                self.runs += 1
                self.exit_codes[c][str(r.exit_code if r.signal is None else f"signal {r.signal}")] += 1
                for holder in (self.__dict__, peaks):
                    if holder["slowest"] is None or r.seconds > holder["slowest"]["seconds"]:
                        holder["slowest"] = {"id": ident, "command": c, "seconds": round(r.seconds, 3),
                                             "mutant": m.label()}
                    if r.rss_kb and (holder["max_rss"] is None or r.rss_kb / 1024 > holder["max_rss"]["rss_mb"]):
                        holder["max_rss"] = {"id": ident, "command": c, "rss_mb": round(r.rss_kb / 1024, 1),
                                             "mutant": m.label()}
            if outcome.oracle is not None and outcome.oracle.get("unchecked"):
                self.oracle_unchecked += 1
                self.unchecked_globals.update(outcome.oracle["unchecked"])
                if len(self.unchecked_examples) < 5:
                    self.unchecked_examples.append(f"{ident}: {m.label()[:160]}")
            elif outcome.oracle is not None:
                self.oracle_checked += 1
                self.oracle_seconds += outcome.oracle.get("seconds", 0) or 0
            if outcome.violations:
                self.failing += 1
            for cls in outcome.classes():
                self.classes[cls] += 1
            for v in outcome.violations:
                sig = _signature(v.cls, v.detail)
                entry = self.signatures.setdefault(sig, {"class": v.cls, "count": 0, "example": None,
                                                         "mutant": None, "dir": None, "formats": Counter()})
                entry["count"] += 1
                entry["formats"][m.format] += 1
                if entry["example"] is None:
                    entry.update(example=v.detail[:500], mutant=m.label(), command=v.command, dir=saved)

    def to_json(self) -> dict:
        with self.lock:
            elapsed = time.monotonic() - self.t0
            per = elapsed / max(1, self.mutants + self.explicit)
            sigs = sorted(self.signatures.values(), key=lambda e: (F.CLASSES.index(e["class"]), -e["count"]))
            return {
                "commit": self.commit, "dirty_files": self.dirty,
                "seed": self.args.seed, "jobs": self.args.jobs, "requested_mutants": self.args.mutants,
                "mutants": self.mutants, "explicit_cases": self.explicit, "runs": self.runs,
                "elapsed_s": round(elapsed, 1), "seconds_per_mutant": round(per, 3),
                "extrapolated_s_for_requested": round(per * (self.args.mutants + self.explicit), 1),
                "by_format": dict(self.by_format), "by_kind": dict(sorted(self.by_kind.items())),
                "exit_codes": {c: dict(v) for c, v in self.exit_codes.items()},
                "oracle_checked": self.oracle_checked, "oracle_seconds": round(self.oracle_seconds, 1),
                "oracle_unchecked": {"mutants": self.oracle_unchecked, "globals": dict(self.unchecked_globals),
                                     "examples": self.unchecked_examples},
                "forked_violations_not_reproduced_by_a_fresh_process": self.unconfirmed,
                "failing_mutants": self.failing,
                "counts": {
                    "internal_errors": self.classes["internal-error"],
                    "hangs": self.classes["hang"],
                    "slow_over_20s": self.classes["slow"],
                    "signals": self.classes["signal"],
                    "rss_over_1gb": self.classes["rss"],
                    "oracle_failures": self.classes["oracle-deep"] + self.classes["oracle-shallow"]
                    + self.classes["oracle-mismatch"],
                },
                "classes": {c: self.classes[c] for c in F.CLASSES if self.classes[c]},
                "slowest": self.slowest, "max_rss": self.max_rss, "by_format_peaks": self.by_format_peaks,
                "max_rss_by_input_size": {b: self.rss_by_band[b] for b in _BANDS if b in self.rss_by_band},
                "signatures": [{**e, "formats": dict(e["formats"])} for e in sigs],
            }


_BANDS = ("< 64 KiB", "64 KiB - 1 MiB", "1 - 16 MiB", "16 - 256 MiB", ">= 256 MiB")


def _band(n: int) -> str:
    for limit, name in zip((64 << 10, 1 << 20, 16 << 20, 256 << 20), _BANDS):
        if n < limit:
            return name
    return _BANDS[-1]


def _input_sizes(m: F.Mutant) -> tuple[int, int]:
    """(bytes of what ckpt was given, bytes of the damaged file) of a mutant, before it is removed."""
    def size(p: Path) -> int:
        try:
            if p.is_file():
                return p.stat().st_size
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
        except OSError:
            return 0
    return size(m.path), size(m.dir / m.target) if m.target else 0


def _save_failure(out: Path, ident: str, outcome: F.Outcome) -> str:
    cls = outcome.classes()[0]
    dst = out / "failures" / cls / ident
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    m = outcome.mutant
    shutil.copytree(m.dir, dst / m.dir.name, symlinks=True)
    # explicit path cases keep their outside files next to the checkpoint
    for p in m.dir.parent.iterdir():
        if p != m.dir and not p.name.startswith("."):
            if p.is_dir() and not p.is_symlink():
                shutil.copytree(p, dst / p.name, symlinks=True)
            elif p.is_file():
                shutil.copy(p, dst / p.name)
    (dst / "outcome.json").write_text(json.dumps(outcome.to_json(), indent=1, default=str) + "\n")
    return str(dst / m.dir.name / m.entry) if m.entry else str(dst / m.dir.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutants", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "fuzz")
    ap.add_argument("--formats", default=None,
                    help="comma-separated formats to mutate (default: every format whose catalogue file, "
                         "tests/conformance/formats/, has FUZZ rows)")
    ap.add_argument("--key-space", action="store_true",
                    help="every mutant a key-space one (fuzz_lib.KEY_SPACE_KINDS: a name renamed to hold a "
                         "separator, a dotted name beside the nested one, names that collide once joined)")
    ap.add_argument("--no-explicit", action="store_true", help="skip the explicit cases")
    ap.add_argument("--no-oracle", action="store_true", help="contract only, no library loads")
    ap.add_argument("--environments", type=int, default=2000, metavar="N",
                    help="environments given to every parser of TPU_*, launcher and CKPT_* variables, in this "
                         "process (fuzz_lib.environment_fuzz: about 1 ms each; 0: none)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="stop starting mutants after this many seconds (the summary says how many ran)")
    ap.add_argument("--start", type=int, default=0, help="first mutant index (to replay: --start I --mutants 1)")
    ap.add_argument("--run-roots", type=int, default=None, metavar="N",
                    help="run-root mutants (pointer and tracker files rewritten, step-named entries beside the "
                         "steps: fuzz_lib.make_run_root_mutant), checked by ls, latest and validate of the root "
                         "too (default: a tenth of --mutants; 0: none)")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    formats = args.formats.split(",") if args.formats else list(F.format_weights())

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)  # a killed run still writes its summary

    args.out.mkdir(parents=True, exist_ok=True)
    work_root = Path(tempfile.mkdtemp(prefix="ckpt-fuzz-"))
    summary = Summary(args)
    # the worker imports (and warms up) only the libraries of the formats fuzzed
    needed = tuple(sorted({s.oracle for s in F.FIXTURE_SPECS if s.format in formats and s.oracle}))
    oracle = None if args.no_oracle else F.Oracle(needed)
    oracle_lock = threading.Lock()

    class LockedOracle:
        def check(self, *a, **k):
            with oracle_lock:
                return oracle.check(*a, **k)

    locked = None if oracle is None else LockedOracle()
    mutant_lock = threading.Lock()  # torch's unpickling in the structured operators, one at a time

    def write_summary() -> None:
        (args.out / "summary.json").write_text(json.dumps(summary.to_json(), indent=1, default=str) + "\n")

    jobs: list[tuple[str, object]] = []
    if not args.no_explicit:
        jobs += [(f"explicit-{name}", name) for name in F.explicit_cases()]
    jobs += [(f"m{args.seed}-{i:05d}", i) for i in range(args.start, args.start + args.mutants)]
    run_roots = args.mutants // 10 if args.run_roots is None else args.run_roots
    jobs += [(f"r{args.seed}-{i:05d}", ("root", i)) for i in range(args.start, args.start + run_roots)]
    queue_lock = threading.Lock()
    cases = F.explicit_cases()
    stop = threading.Event()

    def worker(wid: int) -> None:
        zygote = F.Zygote()
        try:
            while not stop.is_set():
                with queue_lock:
                    if not jobs:
                        return
                    ident, what = jobs.pop(0)
                if args.time_budget and time.monotonic() - summary.t0 > args.time_budget:
                    stop.set()
                    return
                work = work_root / ident
                work.mkdir()
                try:
                    if isinstance(what, tuple):  # a run-root mutant: its own commands and checks
                        with mutant_lock:
                            m = F.make_run_root_mutant(random.Random(f"{args.seed}:root:{what[1]}"), work)
                        outcome = F.evaluate_run_root(m)
                        saved = _save_failure(args.out, ident, outcome) if outcome.violations else None
                        summary.add(ident, outcome, [], saved)
                        if outcome.violations:
                            print(f"{ident}: {outcome.classes()} {m.label()[:140]}", flush=True)
                        continue
                    with mutant_lock:
                        if isinstance(what, str):
                            m = cases[what](work)
                        else:
                            rng = random.Random(f"{args.seed}:{what}")
                            if args.key_space:
                                m = F.pick_key_space_mutant(rng, work, formats)
                            else:
                                spec = F.pick_spec(rng, formats)
                                m = F.make_mutant(rng, spec, work)
                    outcome, unconfirmed = F.evaluate_forked(m, zygote, locked)
                    saved = _save_failure(args.out, ident, outcome) if outcome.violations else None
                    summary.add(ident, outcome, unconfirmed, saved)
                    if outcome.violations:
                        print(f"{ident}: {outcome.classes()} {m.label()[:140]}", flush=True)
                except Exception as exc:  # noqa: BLE001 - a harness problem: say so, go on
                    print(f"{ident}: harness error {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                done = summary.mutants + summary.explicit
                if done % 100 == 0:
                    write_summary()
                    print(f"-- {done} done, {summary.failing} failing, "
                          f"{time.monotonic() - summary.t0:.0f} s", flush=True)
        finally:
            zygote.close()

    # the environment parsers first, in this process (no checkpoint, no child process needed)
    env_failing = F.environment_fuzz(args.seed, args.environments)
    for env, violations in env_failing:
        for v in violations:
            print(f"environment: {v.cls} {v.command}: {v.detail[:300]}", flush=True)
    (args.out / "environments.json").write_text(json.dumps(
        {"environments": args.environments, "failing": len(env_failing),
         "violations": [[v.__dict__ for v in vs] for _, vs in env_failing]}, indent=1) + "\n")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.jobs)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(1.0)
    except KeyboardInterrupt:
        stop.set()
        print("interrupted: writing the summary of what ran", file=sys.stderr)
    finally:
        if oracle is not None:
            oracle.close()
        write_summary()
        shutil.rmtree(work_root, ignore_errors=True)
    s = summary.to_json()
    print(json.dumps({k: s[k] for k in ("mutants", "explicit_cases", "runs", "elapsed_s", "counts", "classes",
                                        "slowest", "max_rss")}, indent=1, default=str))
    print(json.dumps({"environments": args.environments, "failing_environments": len(env_failing)}))
    return 1 if s["failing_mutants"] or env_failing else 0


if __name__ == "__main__":
    sys.exit(main())
