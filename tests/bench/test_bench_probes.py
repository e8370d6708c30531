"""The bench's diagnostic scripts run and report what they say they do (small sizes, this machine)."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_write_pipeline_probe_times_every_variant(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "write_pipeline_probe.py"), str(tmp_path / "w"),
                        "--gib", "0.03", "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    timed = {k: v for k, v in doc.items() if isinstance(v, float) and k != "gib"}
    assert "cp -r && sync" in timed and any(k.startswith("syncfs-at-end") for k in timed), doc
    assert len(timed) >= 9 and all(v > 0 for v in timed.values()), doc
    assert not (tmp_path / "w" / "v").exists()  # its scratch is gone


def test_sampler_reports_threads_phases_and_a_timeline(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make = ("import numpy as np, safetensors.numpy as st; "
            f"st.save_file({{'w': np.arange(4096, dtype=np.float32).reshape(64, 64)}}, {str(src / 'model.safetensors')!r})")
    src.mkdir()
    subprocess.run([sys.executable, "-c", make], check=True, timeout=120)
    report = tmp_path / "report.txt"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sampler.py"), "--out", str(report), "-m", "ckpt_tool",
                        "convert", str(src), str(dst), "--to", "dcp"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    text = report.read_text()
    assert text.startswith("wall ") and "MainThread" in text and "main thread's phases" in text
    timeline = text.split("timeline:", 1)[1].splitlines()[1:]
    assert timeline and timeline[0].split()[0] == "0.00", text
    assert (dst / ".metadata").exists()
