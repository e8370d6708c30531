"""Where a whole ckpt run spends its time, thread by thread: a sampling profiler.

    python bench/sampler.py [--interval S] [--out FILE] -- -m ckpt_tool reshard SRC DST --mesh ...

cProfile sees one thread and slows every call; a reshard's time is spent in
its copy threads, tensorstore's futures and the page-cache thread. This runs
the module in this process while a daemon thread reads every other thread's
Python stack every `--interval` seconds (sys._current_frames), so a thread
blocked in C (a pwrite, an fsync, a tensorstore read, a lock) is charged to
the Python line that called it. The report (stderr, or --out) gives, for the
run's wall time, the samples per thread and the top frames: `self` where
threads were (their innermost frame), `inclusive` the functions on their
stacks, both as a share of one thread's whole time. Idle waits (a worker
waiting for work) are named as such, so they do not hide the busy frames.
"""
from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import threading
import time
from typing import Any, Counter

BUCKET = 0.25  # seconds per line of the report's timeline
# innermost frames that mean "this thread waits for work", not "this thread is busy"
IDLE = {("threading.py", "wait"), ("queue.py", "get"), ("thread.py", "_worker"), ("threading.py", "_wait_for_tstate_lock")}


def _frame_name(frame: Any) -> tuple[str, str, int]:
    code = frame.f_code
    return os.path.basename(code.co_filename), code.co_name, frame.f_lineno


class Sampler:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples = 0
        self.leaf: Counter[tuple[str, str, int]] = collections.Counter()
        self.inclusive: Counter[tuple[str, str]] = collections.Counter()
        self.threads: Counter[str] = collections.Counter()
        self.idle: Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._me = 0
        self._t0 = time.perf_counter()
        # the main thread's phases: (seconds since start, its innermost ckpt_tool frame)
        self.timeline: list[tuple[float, str]] = []
        self._main = threading.main_thread().ident
        # per BUCKET seconds of the run: samples taken, busy samples per thread group, busy leaves
        self.bucket_samples: Counter[int] = collections.Counter()
        self.bucket_busy: dict[int, Counter[str]] = collections.defaultdict(collections.Counter)
        self.bucket_leaf: dict[int, Counter[tuple[str, str, int]]] = collections.defaultdict(collections.Counter)

    def _run(self) -> None:
        self._me = threading.get_ident()
        names = {}
        while not self._stop.wait(self.interval):
            names.update({t.ident: t.name for t in threading.enumerate()})
            self.samples += 1
            bucket = int((time.perf_counter() - self._t0) / BUCKET)
            self.bucket_samples[bucket] += 1
            for ident, frame in sys._current_frames().items():
                if ident == self._me:
                    continue
                if ident == self._main:
                    self._phase(frame)
                name = names.get(ident, str(ident)).split("_")[0].rstrip("-0123456789")
                self.threads[name] += 1
                leaf = _frame_name(frame)
                if leaf[:2] in IDLE:
                    self.idle[name] += 1
                    continue
                self.leaf[leaf] += 1
                self.bucket_busy[bucket][name] += 1
                self.bucket_leaf[bucket][leaf] += 1
                seen = set()
                f = frame
                while f is not None:
                    key = _frame_name(f)[:2]
                    if key not in seen:
                        seen.add(key)
                        self.inclusive[key] += 1
                    f = f.f_back

    def _phase(self, frame: Any) -> None:
        f, where = frame, "?"
        while f is not None:
            if "ckpt_tool" in f.f_code.co_filename:
                where = f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}"
                break
            f = f.f_back
        if not self.timeline or self.timeline[-1][1] != where:
            self.timeline.append((time.perf_counter() - self._t0, where))

    def start(self) -> None:
        threading.Thread(target=self._run, name="sampler", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def report(self, wall: float, top: int = 45) -> str:
        n = max(self.samples, 1)
        lines = [f"wall {wall:.2f} s, {self.samples} samples every {self.interval * 1000:.0f} ms"]
        lines.append("threads (samples as thread-seconds; idle = waiting for work):")
        for name, count in self.threads.most_common():
            lines.append(f"  {name:<28} {count * wall / n:7.2f} s  idle {self.idle[name] * wall / n:6.2f} s")
        lines.append("self (innermost frame), thread-seconds:")
        for (file, func, line), count in self.leaf.most_common(top):
            lines.append(f"  {count * wall / n:7.2f} s  {file}:{line} {func}")
        lines.append("inclusive, thread-seconds (thread plumbing left out):")
        plumbing = {"threading.py", "thread.py", "<frozen runpy>", "sampler.py"}
        for (file, func), count in [kv for kv in self.inclusive.most_common() if kv[0][0] not in plumbing][:top]:
            lines.append(f"  {count * wall / n:7.2f} s  {file} {func}")
        lines.append("main thread's phases (from second: innermost ckpt_tool frame; runs under 50 ms left out):")
        spans = [(t, (self.timeline[i + 1][0] if i + 1 < len(self.timeline) else wall) - t, w)
                 for i, (t, w) in enumerate(self.timeline)]
        for t, d, w in spans:
            if d >= 0.05:
                lines.append(f"  {t:6.2f} +{d:5.2f} s  {w}")
        lines.append(f"timeline: busy threads per group (mean over each {BUCKET:.2f} s), then the busiest lines")
        for b in sorted(self.bucket_samples):
            k = self.bucket_samples[b]
            busy = "  ".join(f"{g} {c / k:.1f}" for g, c in self.bucket_busy[b].most_common())
            leaves = ", ".join(f"{f}:{ln} {c / k:.1f}" for (f, _, ln), c in self.bucket_leaf[b].most_common(4))
            lines.append(f"  {b * BUCKET:5.2f}  {busy}  | {leaves}")
        return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.005)
    parser.add_argument("--out")
    parser.add_argument("-m", dest="module", required=True)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    sampler = Sampler(opts.interval)
    sys.argv = [opts.module, *opts.args]
    code: Any = 0
    t = time.perf_counter()

    def write_report() -> None:
        sampler.stop()
        text = sampler.report(time.perf_counter() - t)
        if opts.out:
            with open(opts.out, "w") as fh:
                fh.write(text + "\n")
        else:
            print(text, file=sys.stderr)

    real_exit = os._exit

    def exit_after_report(status: int) -> None:  # read-only commands skip teardown with os._exit
        write_report()
        real_exit(status)

    os._exit = exit_after_report  # type: ignore[assignment]
    sampler.start()
    try:
        runpy.run_module(opts.module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        write_report()
    return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
