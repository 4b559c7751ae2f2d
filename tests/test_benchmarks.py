"""The benchmark scripts run end to end (smoke size); they print figures and never assert speed."""

import json
import math
import os
import runpy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sinkattn.testing import bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
UNTIMED = {"cache_memory", "compensated"}      # nothing timed: no --repeats


def timed(x) -> bool:
    """A time (or a rate): a positive finite number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


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
    blocks_table = "\n".join(line for line in stdout.splitlines() if line.startswith("|"))
    assert blocks_table.startswith("| shape (sm90 tiles)")
    assert blocks_table in (ROOT / "docs" / "backends.md").read_text()


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


def test_hf_layout_benchmark_quick(tmp_path):
    out = tmp_path / "hf_layout.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_layout.py"), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["B"], r["S"], r["slots"]) for r in rows] == [(1, 64, 66), (2, 32, 68)]
    assert all(r["ms"]["traced"] > 0 and r["ms"]["eager mode"] > 0 for r in rows) and "slots" in run.stdout


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
    assert all(e["max_rank_seconds_min"] <= e["max_rank_seconds"] <= e["max_rank_seconds_max"]
               for e in report["summary"])
    assert "x single" in run.stdout and (report["noise_warning"] is None) == ("noise:" not in run.stdout)


def test_trl_step_benchmark_quick(tmp_path):
    pytest.importorskip("trl", minversion="1.16")
    out = tmp_path / "trl.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trl_step.py"), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    ours, eager = report["rows"]
    assert (ours["impl"], eager["impl"]) == ("sinkattn", "eager")
    assert ours["batch"] == [1, sum(report["lengths"])] and eager["batch"] == [len(report["lengths"]),
                                                                               max(report["lengths"])]
    assert all(r["seconds"] > 0 and r["peak_growth_mib"] is not None for r in report["rows"])
    assert abs(ours["first_loss"] - eager["first_loss"]) < 0.05 * eager["first_loss"]   # the same tokens scored
    assert "sinkattn packed / eager padded: time" in run.stdout


def _quick(script, tmp_path, *extra):
    out = tmp_path / f"{script}.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--quick", "--json", str(out),
                          *extra], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout, json.loads(out.read_text())


def test_decode_benchmark_quick(tmp_path):
    pytest.importorskip("transformers", minversion="5.4")
    stdout, report = _quick("decode", tmp_path)
    calls = [r for r in report["rows"] if r["section"] == "call"]
    assert {(r["B"], r["Sk"]) for r in calls} == {(1, 16), (1, 128), (4, 16), (4, 128)}
    assert all(r["seconds"][p]["wall"] > 0 for r in calls for p in ("sinkattn", "sdpa", "eager"))
    generated = [r for r in report["rows"] if r["section"] == "generate"]
    assert [(r["model"], r["prompt"]) for r in generated] == [
        ("tiny", 32), ("tiny", 128), ("gpt-oss attention", 32), ("gpt-oss attention", 128)]
    assert all(r["same_tokens"] for r in generated)
    assert "vs sdpa" in stdout and "x eager" in stdout


def test_packing_benchmark_quick(tmp_path):
    stdout, report = _quick("packing", tmp_path)
    assert set(report["ratios"]) == {"short_fwd", "short_fwdbwd", "long-tailed_fwd", "long-tailed_fwdbwd",
                                     "short-heavy_fwd", "short-heavy_fwdbwd", "empty_fwdbwd"}
    timed = [r for r in report["rows"] if r["section"] != "threshold"]
    assert all(r["seconds"] > 0 and r["visible_pairs"] > 0 for r in timed)
    assert [r["L"] for r in report["rows"] if r["section"] == "threshold"] == [2, 8]
    assert "target <= 1.2" in stdout and "[threshold]" in stdout


def test_nonfinite_benchmark_quick(tmp_path):
    stdout, report = _quick("nonfinite", tmp_path)
    assert [(r["shape"].split()[5], r["mode"]) for r in report["rows"]] == [
        ("float32", "fwd"), ("float32", "fwdbwd"), ("bfloat16", "fwd"), ("bfloat16", "fwdbwd")]
    assert "budget < 2%" in stdout


def test_hf_benchmark_passes_threads_to_its_fresh_processes():
    """A full run measures in fresh processes: ``--threads`` must reach them (each row says what it ran with)."""
    pytest.importorskip("transformers", minversion="5.4")
    hf = runpy.run_path(str(ROOT / "benchmarks" / "hf.py"))
    threads = torch.get_num_threads() + 1                     # not what a process picks by itself
    row = hf["_fresh"]("time", "sinkattn", 1, 16, 1, hf["MODEL"], threads)
    assert row["threads"] == threads and timed(row["seconds"]) and row["samples"] == [row["seconds"]]


def test_script_parser_defaults_and_refusals(capsys):
    ap = bench.script_parser("d", repeats=7, quick="q")
    args = bench.parse_script_args(ap, [])
    assert (args.quick, args.repeats, args.threads, args.json) == (False, 7, None, None)
    described = bench.parse_script_args(bench.script_parser("d", repeats="10, tiny 1", quick="q", threads="at most 2"),
                                        [])
    assert described.repeats is None and described.threads is None      # the script picks; the help says how
    assert not hasattr(bench.parse_script_args(bench.script_parser("d", repeats=None, quick="q"), []), "repeats")
    assert bench.parse_script_args(bench.script_parser("d", repeats=3, quick="q", threads=1), []).threads == 1
    for bad in (["--repeats", "0"], ["--threads", "0"], ["--threads", "-2"]):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_script_args(bench.script_parser("d", repeats=3, quick="q"), bad)
        assert exit_.value.code == 2 and f"argument {bad[0]}: must be at least 1" in capsys.readouterr().err


def test_parse_script_args_sets_the_threads():
    before = torch.get_num_threads()
    try:
        args = bench.parse_script_args(bench.script_parser("d", repeats=3, quick="q"), ["--threads", str(before + 1)])
        assert args.threads == before + 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_every_script_takes_the_common_options():
    def helps(script):
        return subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--help"],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    with ThreadPoolExecutor(4) as pool:
        runs = dict(zip(SCRIPTS, pool.map(helps, SCRIPTS)))
    assert len(SCRIPTS) == 11 and UNTIMED < set(SCRIPTS)
    for script, run in runs.items():
        assert run.returncode == 0, (script, run.stderr[-2000:])
        listed = run.stdout.split("\noptions:\n")[-1]                  # the options, not the description
        options = {word.rstrip(",") for word in listed.split() if word.startswith("--")}
        assert {"--quick", "--threads", "--json"} <= options, (script, run.stdout)
        assert ("--repeats" in options) == (script not in UNTIMED), (script, run.stdout)
        assert "torch threads (default" in listed and "write every figure to this file" in listed
