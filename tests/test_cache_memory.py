"""Packed training changes lengths every step: resident memory must stay flat (no per-length cache)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cache_memory.py"


def test_rss_stays_flat_over_calls_with_new_lengths(tmp_path):
    out = tmp_path / "rss.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--calls", "60", "--report", "20", "--max-len", "3000",
                          "--window", "2047,2047", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["growth_mib"] < 256, run.stdout
