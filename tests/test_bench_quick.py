"""Smoke test of benchmarks/bench.py: the --quick run finishes and reports every implementation."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


def test_bench_quick(tmp_path):
    env = dict(os.environ)
    # Tiny programs: skip LLVM's optimisations, compile time is most of the run on CPU.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "out"
    # From tmp_path, so the installed package (with its compiled extension) is imported.
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED" not in proc.stderr, proc.stderr[-3000:]

    report = (out / "bench.md").read_text()
    assert report.strip() in proc.stdout  # the same table is printed and written
    rows = [line.split("|")[1:-1] for line in report.splitlines() if re.match(r"\| bf16 ", line)]
    seen = {(cells[1].strip(), cells[2].strip()) for cells in rows}
    for impl in ("ours", "reference", "conv_general_dilated", "copy"):
        for op in ("fwd", "bwd", "fwd+bwd"):
            assert (impl, op) in seen, f"no row for {impl} {op}"
    for cells in rows:
        queue_us, loop_us = float(cells[3]), float(cells[4].rstrip(" !"))
        assert queue_us > 0 and loop_us > 0, cells
    assert (out / "bench.json").is_file()
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plot" in proc.stderr
    else:
        assert (out / "bench.png").stat().st_size > 0
