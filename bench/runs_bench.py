#!/usr/bin/env python3
"""Benchmark `ckpt ls` (and `ckpt latest`) on run roots of 200 steps, locally and on S3.

    python bench/runs_bench.py [--steps N] [--runs N] [--json]

Two roots, each N committed steps copied from a real writer's step plus that writer's torn step:
  dcp    torchtitan's layout: step-N/ holding .metadata + __0_0.distcp (fixtures/runs_torchtitan's
         step-30; torn: step-40's lone .distcp), 2 files a step
  orbax  an Orbax CheckpointManager root: N/ as orbax 0.12 writes it (fixtures/runs_orbax's step 3:
         _CHECKPOINT_METADATA, commit markers, an OCDBT item), 11 files a step; torn: the
         SIGKILLed async save's `4.orbax-checkpoint-tmp`
Locally each is written under bench/out/; on S3 it is uploaded to the tests' S3-compatible server
(moto, started on 127.0.0.1 as tests/conftest.py starts it). Each command is a WHOLE PROCESS (the
.venv's `ckpt`), run once as a warm-up (output checked: N+1 rows, the torn step not committed,
latest = the Nth step), then --runs times; the best wall time counts.

Target (issue 22): `ckpt ls` < 1 s on a root of 200 steps, locally and on S3. moto answers a LIST
at about 0.7 ms per key (the orbax root's 2,201 keys: ~1.6 s for the LIST alone), so the target
is checked on the dcp root; the orbax root's figures are reported beside it. Exit 0 when every
command ran and its output checked out (target met or not); 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from cli_start_bench import ckpt_exe  # noqa: E402
from inspect_bench import _fmt_mib, run_once  # noqa: E402 - one way to time a child, shared by the benches

TARGET_S = 1.0
BUCKET = "ckpt-runs-bench"


# root -> (source root, the step copied, the torn entry, the step-directory name of step n)
ROOTS = {
    "dcp": (os.path.join(REPO, "fixtures", "runs_torchtitan"), "step-30", "step-40", "step-{n}"),
    "orbax": (os.path.join(REPO, "fixtures", "runs_orbax"), "3", "4.orbax-checkpoint-tmp", "{n}"),
}


def make_root(kind: str, path: str, steps: int) -> None:
    """`steps` committed steps (copies of one real step) and the writer's torn step after them."""
    src, step, torn, named = ROOTS[kind]
    if os.path.isdir(path) and len(os.listdir(path)) == steps + 1:
        return
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    for n in range(1, steps + 1):
        shutil.copytree(os.path.join(src, step), os.path.join(path, named.format(n=n)))
    torn_name = torn.replace(torn.split(".")[0].rsplit("-", 1)[-1], str(steps + 1), 1)
    shutil.copytree(os.path.join(src, torn), os.path.join(path, torn_name))


def upload(root: str, endpoint: str, prefix: str) -> int:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from conftest import s3_client

    s3 = s3_client(endpoint)
    if not any(b["Name"] == BUCKET for b in s3.list_buckets().get("Buckets", [])):
        s3.create_bucket(Bucket=BUCKET)
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: s3.upload_file(p, BUCKET, prefix + os.path.relpath(p, root)), files))
    return len(files)


def check(what: str, out: str, steps: int) -> list[str]:
    """What is wrong with a warm-up's output (nothing: [])."""
    if what == "inspect":
        return [] if "dcp_single" in out else [f"inspect printed {out[:80]!r}"]
    if what == "latest":
        last = out.strip().rsplit("/", 1)[-1]
        return [] if last in (str(steps), f"step-{steps}") else [f"latest printed {out.strip()[-80:]!r}, not step {steps}"]
    try:
        doc = json.loads(out)
    except ValueError:
        return [f"ls printed no JSON: {out[:80]!r}"]
    rows = doc.get("steps", [])
    errors = [] if len(rows) == steps + 1 else [f"ls listed {len(rows)} steps, not {steps + 1}"]
    if rows and rows[-1]["status"] == "committed":
        errors.append(f"the torn step is {rows[-1]['status']}")
    return errors


def time_command(name: str, argv: list[str], runs: int, steps: int, env: dict | None = None) -> dict:
    res = {"name": name, "command": " ".join(["ckpt"] + argv[1:]), "ok": True, "error": None, "runs_s": [],
           "best_s": None, "peak_rss_kib": None, "check_errors": []}
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        r = run_once(argv, capture=True)
        if r["rc"] != 0:
            res.update(ok=False, error=f"exit {r['rc']}: {r['stderr'].strip()[-200:]}")
            return res
        res["check_errors"] = check(name.split()[-1], r["stdout"], steps)
        for _ in range(max(runs, 1)):
            r = run_once(argv, capture=False)
            res["runs_s"].append(round(r["wall"], 4))
            res["peak_rss_kib"] = max(res["peak_rss_kib"] or 0, r["rss_kib"])
    finally:
        os.environ.clear()
        os.environ.update(old)
    res["best_s"] = min(res["runs_s"])
    print(f"{res['command']}: best {res['best_s']:.3f} s of {runs}", file=sys.stderr, flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=200, help="steps in the root (default 200)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per command after one warm-up (default 3)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args, _unknown = ap.parse_known_args(argv)  # run_all passes every bench its own arguments

    exe = ckpt_exe()
    results, files = [], {}
    # the floor of any ckpt command that opens a checkpoint (interpreter, click, numpy, tensorstore):
    # on a loaded machine the targets' seconds move with it, the ratio to it much less
    floor = time_command("floor inspect", exe + ["inspect", os.path.join(REPO, "fixtures", "dcp_single")], args.runs,
                         args.steps)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from conftest import moto_s3_serving

    with moto_s3_serving(BUCKET, []) as env:
        for kind in ROOTS:
            root = os.path.join(HERE, "out", f"runs_{kind}_{args.steps}")
            make_root(kind, root, args.steps)
            files[kind] = sum(len(fs) for _, _, fs in os.walk(root))
            results += [
                time_command(f"{kind} local ls", exe + ["ls", root, "--json"], args.runs, args.steps),
                time_command(f"{kind} local latest", exe + ["latest", root], args.runs, args.steps),
            ]
            n = upload(root, env["AWS_ENDPOINT_URL"], f"{kind}/")
            print(f"uploaded {n} files to the S3 server", file=sys.stderr, flush=True)
            url = f"s3://{BUCKET}/{kind}"
            results += [
                time_command(f"{kind} s3 ls", exe + ["ls", url, "--json"], args.runs, args.steps, env),
                time_command(f"{kind} s3 latest", exe + ["latest", url], args.runs, args.steps, env),
            ]
    ls_rows = [r for r in results if r["name"].startswith("dcp ") and r["name"].endswith(" ls")]
    doc = {
        "bench": "runs", "steps": args.steps, "files": files, "runs": args.runs, "target_s": TARGET_S,
        "results": results, "floor": floor,
        "met": all(r["best_s"] is not None and r["best_s"] < TARGET_S for r in ls_rows),
        "ok": all(r["ok"] and not r["check_errors"] for r in results + [floor]),
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_table(doc)
    return 0 if doc["ok"] else 1


def _print_table(doc: dict) -> None:
    print(f"ckpt ls / latest on run roots of {doc['steps']} steps, whole processes, best of {doc['runs']}:")
    for r in doc["results"]:
        status = "ok" if r["ok"] and not r["check_errors"] else f"FAILED: {r['error'] or '; '.join(r['check_errors'])}"
        best = "-" if r["best_s"] is None else f"{r['best_s']:.3f} s"
        kind = r["name"].split()[0]
        print(f"  {r['name']:<19} ({doc['files'].get(kind, '?')} files) {best:>8}  {_fmt_mib(r['peak_rss_kib']):>9}  {status}")
    f = doc.get("floor") or {}
    if f.get("best_s"):
        print(f"  floor: {f['command']} {f['best_s']:.3f} s (any ckpt command opening a checkpoint)")
    print(f"  target: ckpt ls < {doc['target_s']:g} s on the dcp root, locally and on S3: " + ("MET" if doc["met"] else "MISSED"))


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table: each command; ls on the dcp root against 1 s."""
    rows = []
    floor = (doc.get("floor") or {}).get("best_s")
    for r in doc.get("results", []):
        kind, where, what = r["name"].split()
        targeted = kind == "dcp" and what == "ls"
        best = r.get("best_s")
        rss = r.get("peak_rss_kib")
        files = (doc.get("files") or {}).get(kind)
        rows.append({
            "bench": "runs", "case": f"ckpt {what}, {kind} root of {doc.get('steps')} steps ({files} files), {where}",
            "ckpt_s": best, "baseline": "ckpt inspect dcp_single" if floor else None, "baseline_s": floor,
            "ratio": round(best / floor, 2) if best and floor else None,
            "target": f"< {doc.get('target_s', TARGET_S):g} s" if targeted else None,
            "met": (best is not None and best < doc.get("target_s", TARGET_S)) if targeted else None,
            "rss_mib": round(rss / 1024) if rss else None,
            "error": r.get("error") or "; ".join(r.get("check_errors", [])),
        })
    return rows


if __name__ == "__main__":
    sys.exit(main())
