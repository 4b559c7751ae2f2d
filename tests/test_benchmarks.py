"""The benchmark scripts run end to end (smoke size); they print figures and never assert speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_benchmark_quick(tmp_path):
    out = tmp_path / "cpu.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu.py"), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["section"] for r in rows} == {"speed", "memory", "window"}
    assert "vs sdpa" in run.stdout and "peak growth" in run.stdout


def _gpu_benchmark(tmp_path, *args):
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--json", str(out), *args],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def test_gpu_benchmark_end_to_end_on_tiny_shapes(tmp_path):
    """Every section of the GPU benchmark through the interpreter (its figures are not GPU figures)."""
    report, stdout = _gpu_benchmark(tmp_path, "--sections", "blocks,check,speed,sweep")
    assert report["verdict"] == {"correctness_passed": True, "finished": True}
    assert len(report["check"]) == 2 and all(r["passed"] and r["deterministic"] for r in report["check"])
    timed = {(r["problem"], r["provider"], r["mode"]) for r in report["speed"] if r["ms"]}
    for problem in ("tiny causal fp16", "tiny packed w8 bf16"):
        assert {(problem, p, m) for p in ("sinkattn", "sinkattn_nosink") for m in ("fwd", "bwd", "fwdbwd")} <= timed
    assert ("tiny causal fp16", "sdpa_flash", "fwdbwd") in timed
    assert {(r["kernel"], r["table_choice"]) for r in report["sweep"] if "ms" in r} >= {
        (k, True) for k in ("fwd", "dq", "dkdv")}
    assert {r["chip"] for r in report["blocks"]} == {"sm80", "sm86", "sm90", "sm100"}
    assert {r["problem"] for r in report["blocks"]} >= {"ascend fp16", "gpt-oss packed window 128"}
    assert "verdict: correctness PASS" in stdout


def test_gpu_benchmark_skips_what_the_time_budget_leaves_no_time_for(tmp_path):
    report, stdout = _gpu_benchmark(tmp_path, "--budget", "1", "--sections", "check,speed")
    assert report["check"] and all(r["skipped"] == "time budget" for r in report["check"])
    assert report["speed"] and all(r["skipped"] == "time budget" for r in report["speed"])
    assert report["verdict"]["finished"]


def test_hf_benchmark_quick(tmp_path):
    pytest.importorskip("transformers", minversion="5.4")
    out = tmp_path / "hf.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf.py"), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [r["impl"] for r in report["rows"]] == ["sinkattn", "eager", "sinkattn"]
    assert all(r["seconds"] > 0 and r["peak_growth_mib"] is not None for r in report["rows"])
    assert "time_vs_eager" in report["ratios"] and "not run" in run.stdout


def test_hf_benchmark_ratio_has_no_value_when_the_peer_measured_zero():
    """A smoke run in one process can reuse freed heap: eager's growth of 0 MiB once divided by zero."""
    import runpy
    hf = runpy.run_path(str(ROOT / "benchmarks" / "hf.py"))
    assert hf["_ratio"](321.0, 0.0) is None and hf["_show"](None).startswith("n/a")
    assert hf["_ratio"](1.0, 4.0) == 0.25


def test_compensated_benchmark_smoke(tmp_path):
    out = tmp_path / "compensated.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compensated.py"), "--seeds", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["compensated"]) for r in rows] == [
        ("float16", False), ("float16", True), ("bfloat16", False), ("bfloat16", True)]
    assert all({"o", "lse", "dq", "dk", "dv"} <= set(r["worst"]) for r in rows)
    assert "fail Gate A" in run.stdout


def test_cp_benchmark_quick(tmp_path):
    out = tmp_path / "cp.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cp.py"), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert {(e["provider"], e["P"]) for e in report["summary"]} == {
        ("single-process", 1), ("ring", 1), ("ring", 2), ("ulysses", 1), ("ulysses", 2)}
    assert sorted({(r["P"], r["rank"]) for r in report["rows"]}) == [(1, 0), (2, 0), (2, 1)]
    assert all(r["seconds"] > 0 and r["peak_growth_mib"] >= 0 for r in report["rows"])
    assert "x single" in run.stdout
