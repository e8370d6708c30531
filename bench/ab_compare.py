#!/usr/bin/env python3
"""ckpt now against ckpt at an older revision, on shapes_bench's shapes, interleaved in one run.

    .venv/bin/python bench/ab_compare.py REV [--shape wide --shape sharded] [--rounds 2] [--json]

For "no regression" claims: the older revision is checked out (git worktree,
detached) under build/ab/REV and run from this same venv (PYTHONPATH first),
so both sides use the same libraries. Each round runs every command once with
each side, alternating which goes first, each a fresh process after a sync and
a pause, the source's page cache warm (shapes_bench's protocol). Commands are
shapes_bench's ckpt commands without --memory (shapes whose ckpt run takes
--memory are refused: older revisions may not have the flag). Prints a table
of best wall times and peak RSS per side; exit 0 when every run exited 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import inspect_bench as ib  # noqa: E402
import shapes_bench as sb  # noqa: E402

REPO = ib.REPO
AB_DIR = os.path.join(REPO, "build", "ab")


def checkout(rev: str) -> tuple[str, str]:
    """A detached worktree of `rev` under build/ab/ (made once); its path and full commit."""
    commit = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    path = os.path.join(AB_DIR, commit[:12])
    if not os.path.isdir(path):
        os.makedirs(AB_DIR, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", path, commit], cwd=REPO, check=True,
                       capture_output=True)
    return path, commit


def commands(shape: str) -> list[tuple[str, list[str], list[str]]]:
    """(name, ckpt arguments, outputs to remove) of shapes_bench's commands on a shape, diff's twin first."""
    src = sb.SHAPES[shape]["src"]
    tmp = os.path.join(sb.TMP, "ab")
    twin, out = os.path.join(tmp, f"{shape}-twin"), os.path.join(tmp, "out")
    rules = os.path.join(tmp, "rules.json")
    os.makedirs(tmp, exist_ok=True)
    with open(rules, "w") as f:
        json.dump([[".*", [None, "model"]]], f)
    rules_args = ["--rules", rules] if shape != "wide" else []
    return [
        ("validate --deep", ["validate", src, "--deep", "--json"], []),
        ("convert --to dcp", ["convert", src, out, "--to", "dcp", "--json"], [out]),
        ("diff --values", ["diff", src, twin, "--values", "--json"], []),
        ("reshard data=2,model=4", ["reshard", src, out, "--mesh", "data=2,model=4", "--devices", "8", "--json",
                                    *rules_args], [out]),
    ]


def run_side(pythonpath: str | None, args: list[str], src: str, outputs: list[str]) -> dict:
    env_before = os.environ.get("PYTHONPATH")
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        return sb._run([sys.executable, "-m", "ckpt_tool", *args], src, outputs)
    finally:
        if pythonpath:
            if env_before is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = env_before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the older revision (a commit, tag or branch)")
    ap.add_argument("--shape", action="append", choices=[s for s, v in sb.SHAPES.items() if not v["memory"]])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    old_path, old_commit = checkout(args.rev)
    new_commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    rows, ok = [], True
    for shape in args.shape or ["wide", "sharded"]:
        sb.ensure(shape, False, log)
        src = sb.SHAPES[shape]["src"]
        cmds = commands(shape)
        twin = cmds[2][1][2]
        shutil.rmtree(twin, ignore_errors=True)  # diff's other side: the source converted once, by today's ckpt
        made = run_side(None, ["convert", src, twin, "--to", "dcp"], src, [])
        if made["rc"] != 0:
            log(f"{shape}: cannot make the DCP twin: {made['stderr'][-300:]}")
            return 1
        for name, argv_, outputs in cmds:
            runs: dict[str, list[dict]] = {"before": [], "now": []}
            for r in range(args.rounds):
                order = ["before", "now"] if r % 2 == 0 else ["now", "before"]
                for side in order:
                    log(f"{shape}: {name} ({side}, round {r + 1})")
                    res = run_side(old_path if side == "before" else None, argv_, src, outputs)
                    if res["rc"] != 0:
                        ok = False
                        log(f"  exit {res['rc']}: {res['stderr'][-300:]}")
                    runs[side].append(res)
            rows.append({
                "shape": shape, "command": name,
                **{f"{side}_s": [round(x["wall"], 3) for x in runs[side]] for side in runs},
                **{f"{side}_rss_mib": max(x["rss_kib"] for x in runs[side]) // 1024 for side in runs},
                "ok": all(x["rc"] == 0 for side in runs for x in runs[side]),
            })
        shutil.rmtree(twin, ignore_errors=True)
    doc = {"before": old_commit, "now": new_commit, "rounds": args.rounds, "rows": rows}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"before = {old_commit[:12]}, now = {new_commit[:12]}, {args.rounds} rounds interleaved; "
              "best wall time (every run's)")
        print("| shape | command | before | now | now/before (best) | peak RSS before | now |")
        print("|---|---|---|---|---|---|---|")

        def runs(xs: list[float]) -> str:
            return f"{min(xs):.2f} s (" + " / ".join(f"{x:.2f}" for x in xs) + ")"

        for r in rows:
            b, n = min(r["before_s"]), min(r["now_s"])
            print(f"| {r['shape']} | {r['command']} | {runs(r['before_s'])} | {runs(r['now_s'])} | {n / b:.2f}x | "
                  f"{r['before_rss_mib']} MiB | {r['now_rss_mib']} MiB |" + ("" if r["ok"] else " (a run FAILED)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
