"""The benchmark scripts run end to end (smoke size); they print figures and never assert speed.

What is checked is that the figures hold together: every time is a positive finite number, every
ratio is the quotient of the figures it is computed from (recomputed here from the same JSON), a
spread is ordered, memory is not negative, counts follow from the problem sizes and verdicts from
the per-case results. Nothing here depends on how fast this machine is."""

import importlib.util
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinkattn.backends import cpu_tiles
from sinkattn.masks import Window
from sinkattn.testing import bench, cases, flops, precision, verify

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
UNTIMED = {"cache_memory", "compensated"}      # nothing timed: no --repeats


def timed(x) -> bool:
    """A time (or a rate): a positive finite number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def memory(x) -> bool:
    """A memory figure: a finite number, not negative."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def quotient(a: float, b: float):
    """``a / b`` as the JSON's ratio should hold it."""
    return pytest.approx(a / b, rel=1e-9)


def samples_hold(row: dict, key: str = "seconds") -> None:
    """``row[key]`` is the median of ``row["samples"]``, every sample a time."""
    assert all(timed(s) for s in row["samples"]), row
    assert min(row["samples"]) <= row[key] <= max(row["samples"])
    assert row[key] == pytest.approx(statistics.median(row["samples"]), rel=1e-12)


# --- the options every script takes -------------------------------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_takes_the_common_options(script, capsys, monkeypatch):
    """Each script's parser (run in this process: its ``main`` exits on ``--help`` before any work) lists
    ``--quick``, ``--threads`` and ``--json``, and ``--repeats`` when it times anything."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{script}", ROOT / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))              # a script imports its neighbours
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out.split("\noptions:\n")[-1]          # the options, not the description
    options = {word.rstrip(",") for word in listed.split() if word.startswith("--")}
    assert {"--quick", "--threads", "--json"} <= options, listed
    assert ("--repeats" in options) == (script not in UNTIMED), listed


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


# --- each script's smoke run ---------------------------------------------------------------------------------------

def _quick(script, tmp_path, *extra, timeout=600, env=None):
    out = tmp_path / f"{script}.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--quick", "--json", str(out),
                          *extra], capture_output=True, text=True, timeout=timeout, env=env)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return run.stdout, json.loads(out.read_text())


def test_cpu_benchmark_quick(tmp_path):
    """Under an AVX2 ceiling (a rerun in a child process): the figures come from the child, held to it."""
    stdout, report = _quick("cpu", tmp_path, "--threads", "1", "--isa", "avx2")
    assert report["header"]["threads"] == 1 and report["header"]["dispatch"] == "avx2"
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in report["header"]["ceiling"]
    rows = report["rows"]
    assert [r["section"] for r in rows] == (["speed"] * 2 + ["memory"] * 3 + ["window"] * 2 + ["small"] * 2
                                            + ["products"] * 2 + ["split"] * 2)
    for r in (r for r in rows if r["section"] == "speed"):
        t = r["seconds"]
        assert set(t) == {"sinkattn", "sdpa", "eager"} and all(timed(x) for x in t.values())
        assert r["speed_vs_sdpa"] == quotient(t["sdpa"], t["sinkattn"])
        assert r["speed_vs_eager"] == quotient(t["eager"], t["sinkattn"])
        assert f"vs sdpa {r['speed_vs_sdpa']:.2f}x" in stdout and "S=256" in r["shape"]
    measured, (eager,) = ([r for r in rows if r["section"] == "memory" and (r["provider"] == "eager") == e]
                          for e in (False, True))
    assert [r["provider"] for r in measured] == ["sinkattn", "sdpa"]
    assert all(memory(r["peak_growth_gib"]) and "S=1024" in r["shape"] for r in measured)
    assert eager["S"] == 1024 and eager["scores_gib"] == 8 * 1024 * 1024 * 4 / 2**30      # 8 heads, fp32
    assert f"{eager['scores_gib']:.1f} GiB" in eager["note"]
    for r in (r for r in rows if r["section"] == "window"):
        t = r["seconds"]
        assert timed(t["causal"]) and timed(t["window_511_0"])
        assert r["window_cost_vs_causal"] == quotient(t["window_511_0"], t["causal"])
        assert f"cost {r['window_cost_vs_causal']:.3f}x" in stdout
    assert "peak growth" in stdout
    dense, packed = (r for r in rows if r["section"] == "small")
    assert "S=64" in dense["shape"] and "packed[96, 40, 72, 48]" in packed["shape"]
    assert set(dense["seconds"]) == {"sinkattn", "sdpa", "eager"} and set(packed["seconds"]) == {"sinkattn", "eager"}
    for r in (dense, packed):
        t = r["seconds"]
        assert all(timed(x) for x in t.values()) and r["speed_vs_eager"] == quotient(t["eager"], t["sinkattn"])
        assert f"vs eager {r['speed_vs_eager']:.2f}x" in stdout and r["shape"] in stdout
    assert dense["speed_vs_sdpa"] == quotient(dense["seconds"]["sdpa"], dense["seconds"]["sinkattn"])
    assert packed["speed_vs_sdpa"] is None
    for r in (r for r in rows if r["section"] == "products"):
        t = r["seconds"]
        assert set(t) == {"fp32_products", "bf16_products", "sdpa"} and all(timed(x) for x in t.values())
        assert r["bf16_vs_fp32_products"] == quotient(t["fp32_products"], t["bf16_products"])
        assert r["bf16_products_vs_sdpa"] == quotient(t["sdpa"], t["bf16_products"])
        assert f"bf16 vs fp32 products {r['bf16_vs_fp32_products']:.2f}x" in stdout and "S=256" in r["shape"]
    one, four = (r for r in rows if r["section"] == "split")
    assert "HKV=1 " in one["shape"] and "HKV=4 " in four["shape"]
    assert one["auto"] == "fused" and four["auto"] == "fused"        # one thread: no thread is idle
    for r in (one, four):
        t = r["seconds"]
        assert set(t) == {"fused", "split"} and all(timed(x) for x in t.values())
        assert r["split_vs_fused"] == quotient(t["fused"], t["split"])
        assert f"split vs fused {r['split_vs_fused']:.2f}x | auto takes {r['auto']}" in stdout


def test_products_benchmark_quick(tmp_path):
    stdout, report = _quick("products", tmp_path, "--threads", "1")
    assert report["header"]["threads"] == 1 and [r["product"] for r in report["rows"]] == ["scores Q K^T", "P V / dS K"]
    for r in report["rows"]:
        s = r["shape"]
        flop = 2.0 * s["batch"] * s["M"] * s["K"] * s["N"]
        assert {"fp32", "bf16_out", "bf16_mode"} <= set(r["seconds"]) and isinstance(r["rounds"], bool)
        for key, t in r["seconds"].items():
            samples_hold(dict(seconds=t, samples=r["samples"][key]))
            assert r["gflops"][key] == quotient(flop, t * 1e9)
            assert r["speed_vs_fp32"][key] == quotient(r["seconds"]["fp32"], t)
        # every variant with an fp32 result is the exact product of these bf16-valued operands up to fp32
        # rounding; bf16_out is rounded to bf16
        scale = 4 * s["K"] * 2.0 ** -24 * 16            # K terms of |a b| < 16 (randn, 4 sigma), a few ulp each
        assert all(r["max_error"][key] < scale for key in r["max_error"] if key != "bf16_out"), r["max_error"]
        assert r["max_error"]["bf16_out"] > r["fp32_max_error"]
        assert f"{r['gflops']['fp32']:6.1f} GFLOP/s" in stdout


def _gpu_benchmark(tmp_path, *args, flag="--tiny"):
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), flag, "--json", str(out), *args],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def _gate_a_holds(report: dict) -> bool:
    """Gate A recomputed from a tensor's figures (docs/contract.md §4)."""
    tol = precision.TOLERANCES[getattr(torch, report["dtype"])]
    return bool(report["special_ok"] and report["ratio"] >= tol.required_ratio
                and report["max_abs_err"] <= tol.max_abs_limit)


def _accepted(report: dict) -> bool:
    return report["gate_a"] or (report["waiver"] is not None and bool(report["waiver_ok"]))


def test_gpu_benchmark_end_to_end_on_tiny_shapes(tmp_path):
    """Every section of the GPU benchmark through the interpreter (its figures are not GPU figures)."""
    report, stdout = _gpu_benchmark(tmp_path, "--sections", "blocks,check,speed,sweep")
    gpu = runpy.run_path(str(ROOT / "benchmarks" / "gpu.py"))
    tiny, full = gpu["speed_problems"](True), gpu["speed_problems"](False)
    assert report["tiny"] is True
    # check: each case's verdict follows from its tensors, the run's verdict from the cases
    assert len(report["check"]) == 2 and all(r["passed"] and r["deterministic"] for r in report["check"])
    for case in report["check"]:
        assert [t["name"] for t in case["reports"]] == ["o", "lse", "dq", "dk", "dv", "dsinks"]
        for t in case["reports"]:
            assert t["gate_a"] == _gate_a_holds(t), t
            assert 0 <= t["ratio"] <= 1 and memory(t["max_abs_err"]) and memory(t["rms_rel_err"])
        assert case["passed"] == (case["error"] is None and case["deterministic"] is not False
                                  and all(_accepted(t) for t in case["reports"]))
        assert timed(case["seconds"])
    assert report["verdict"] == {"correctness_passed": all(c["passed"] for c in report["check"]), "finished": True}
    assert "verdict: correctness PASS" in stdout
    # speed: times, the FLOP rate of each problem's visible pairs, ratios to sinkattn
    timed_rows = [r for r in report["speed"] if r["ms"]]
    ran = {(r["problem"], r["provider"], r["mode"]) for r in timed_rows}
    assert ran >= {(problem, p, m) for problem in tiny for p in ("sinkattn", "sinkattn_nosink")
                   for m in ("fwd", "bwd", "fwdbwd")}
    assert ("tiny causal fp16", "sdpa_flash", "fwdbwd") in ran
    ours = {(r["problem"], r["mode"]): r["ms"] for r in timed_rows if r["provider"] == "sinkattn"}
    for r in timed_rows:
        p = tiny[r["problem"]]
        assert r["label"] == p.label and timed(r["ms"]) and memory(r["peak_growth_mib"]) and r["first_call_s"] >= 0
        assert r["tflops"] == pytest.approx(p.flops(r["mode"]) / (r["ms"] * 1e-3) / 1e12, rel=1e-9)
        if r["provider"] != "sinkattn":
            assert r["sinkattn_time_ratio"] == quotient(ours[r["problem"], r["mode"]], r["ms"])
    # sweep: every timed tile a time; the table's own tile among them for each kernel
    assert {(r["kernel"], r["table_choice"]) for r in report["sweep"] if "ms" in r} >= {
        (k, True) for k in ("fwd", "dq", "dkdv")}
    assert all(timed(r["ms"]) for r in report["sweep"] if "ms" in r)
    # blocks: the visited (tile, block) pairs cover every visible pair of every head, the share is theirs
    assert {r["chip"] for r in report["blocks"]} == {"sm80", "sm86", "sm90", "sm100"}
    assert {r["problem"] for r in report["blocks"]} == set(full)
    by_tile = {}
    for r in report["blocks"]:
        p, (BM, BN) = full[r["problem"]], r["tile"][:2]
        pairs = flops.visible_pairs(p.seq_lens, p.seq_lens, Window.of(p.causal, p.window))
        assert r["interior"] >= 0 and r["cut"] >= 0 and (r["interior"] + r["cut"]) * BM * BN >= pairs * p.HQ, r
        assert r["interior_share"] == round(r["interior"] / (r["interior"] + r["cut"]), 4)
        counts = by_tile.setdefault((r["problem"], r["kernel"], tuple(r["tile"])), (r["interior"], r["cut"]))
        assert counts == (r["interior"], r["cut"]), r              # the same tile counts alike on every chip
    blocks_table = "\n".join(line for line in stdout.splitlines() if line.startswith("|"))
    assert blocks_table.startswith("| shape (sm90 tiles)")
    assert blocks_table in (ROOT / "docs" / "backends.md").read_text()


def test_gpu_benchmark_skips_what_the_time_budget_leaves_no_time_for(tmp_path):
    report, stdout = _gpu_benchmark(tmp_path, "--budget", "1", "--sections", "check,speed", flag="--quick")
    assert report["tiny"] is True                              # --quick is --tiny
    assert report["check"] and all(r == {"case": r["case"], "skipped": "time budget"} for r in report["check"])
    assert report["speed"] and all(r["skipped"] == "time budget" and "ms" not in r for r in report["speed"])
    assert report["verdict"] == {"correctness_passed": None, "finished": True}       # nothing checked
    assert "correctness not checked" in stdout


def test_hf_benchmark_quick(tmp_path):
    pytest.importorskip("transformers", minversion="5.4")
    stdout, report = _quick("hf", tmp_path)
    rows = report["rows"]
    assert [(r["impl"], r["tokens"]) for r in rows] == [("sinkattn", "4 x 64"), ("eager", "4 x 64"),
                                                        ("sinkattn", "4 x 128")]
    for r in rows:
        assert timed(r["seconds"]) and len(r["samples"]) == 1 and memory(r["peak_growth_mib"])
        samples_hold(r)
        assert all(memory(x) for x in r["loadavg"]) and r["threads"] == report["header"]["threads"]
    ours, eager, _ = rows
    assert report["ratios"]["time_vs_eager"] == quotient(ours["seconds"], eager["seconds"])
    if eager["peak_growth_mib"] > 0:
        assert report["ratios"]["peak_growth_vs_eager"] == quotient(ours["peak_growth_mib"], eager["peak_growth_mib"])
    else:
        assert report["ratios"]["peak_growth_vs_eager"] is None
    heads = report["model"]["num_attention_heads"]
    assert report["eager_scores_gib"] == heads * (4 * 128) ** 2 * 4 / 2**30            # fp32 scores of 4 x 128 tokens
    assert f"{report['eager_scores_gib']:.3g} GiB" in report["eager_not_run"] and "not run" in stdout
    assert f"time {report['ratios']['time_vs_eager']:.3f}x" in stdout


def test_hf_benchmark_passes_threads_to_its_fresh_processes():
    """A full run measures in fresh processes: ``--threads`` must reach them (each row says what it ran with)."""
    pytest.importorskip("transformers", minversion="5.4")
    hf = runpy.run_path(str(ROOT / "benchmarks" / "hf.py"))
    threads = torch.get_num_threads() + 1                     # not what a process picks by itself
    row = hf["_fresh"]("time", "sinkattn", 1, 16, 1, hf["MODEL"], threads)
    assert row["threads"] == threads and timed(row["seconds"]) and row["samples"] == [row["seconds"]]


def test_hf_layout_benchmark_quick(tmp_path):
    stdout, report = _quick("hf_layout", tmp_path)
    rows = report["rows"]
    assert [(r["B"], r["S"]) for r in rows] == [(1, 64), (2, 32)]
    for r in rows:
        assert r["slots"] == 2 * r["B"] + r["B"] * r["S"]          # 2B + B*S cu_seqlens slots
        assert timed(r["ms"]["traced"]) and timed(r["ms"]["eager mode"])
        assert r["traced_vs_eager"] == quotient(r["ms"]["traced"], r["ms"]["eager mode"])
        assert all(memory(x) for x in r["loadavg"])
        assert f"({r['slots']} slots)" in stdout and f"{r['traced_vs_eager']:.2f}x" in stdout


def test_hf_benchmark_ratio_has_no_value_when_the_peer_measured_zero():
    """A smoke run in one process can reuse freed heap: eager's growth of 0 MiB once divided by zero."""
    hf = runpy.run_path(str(ROOT / "benchmarks" / "hf.py"))
    assert hf["_ratio"](321.0, 0.0) is None and hf["_show"](None).startswith("n/a")
    assert hf["_ratio"](1.0, 4.0) == 0.25


@pytest.mark.parametrize("backend,dtypes", [("triton", ["float16", "bfloat16"]), ("cpu", ["bfloat16"]),
                                            ("cpu-kernel", ["bfloat16"])])
def test_compensated_benchmark_quick(tmp_path, backend, dtypes):
    stdout, report = _quick("compensated", tmp_path, "--backend", backend)
    rows = report["rows"]
    assert [(r["dtype"], r["compensated"], r["seeds"]) for r in rows] == [
        (dtype, compensated, 1) for dtype in dtypes for compensated in (False, True)]
    assert report["command"] == "python benchmarks/compensated.py" + (f" --backend {backend}" if backend != "triton"
                                                                     else "") + " --seeds 1"
    required = {t.required_ratio for t in precision.TOLERANCES.values()}
    assert len(required) == 1
    for r in rows:
        assert {"o", "lse", "dq", "dk", "dv"} <= set(r["worst"]) and r["wall_s"] >= 0
        assert 0 <= r["failed"] <= r["seeds"] and r["failed"] == len(r["failures"])
        for w in r["worst"].values():
            assert 0 <= w["min_ratio"] <= 1 and memory(w["max_abs_err"])
        if any(w["min_ratio"] < min(required) for w in r["worst"].values()):
            assert r["failed"] >= 1, r                             # a batch under the required ratio failed Gate A
        for f in r["failures"]:                                   # a failing tensor's ratio is no better than worst
            assert all(ratio >= round(r["worst"][t]["min_ratio"], 4) for t, ratio in f["tensors"].items())
        assert f"{r['failed']:3d} of {r['seeds']} fail Gate A" in stdout


def test_cp_benchmark_quick(tmp_path):
    stdout, report = _quick("cp", tmp_path)
    S = report["problem"]["S"]
    assert S == 256 and report["header"]["threads"] == 1         # one torch thread per rank by default
    summary = {(e["provider"], e["P"]): e for e in report["summary"]}
    assert set(summary) == {("single-process", 1), ("ring", 1), ("ring", 2), ("ulysses", 1), ("ulysses", 2)}
    assert sorted({(r["P"], r["rank"]) for r in report["rows"]}) == [(1, 0), (2, 0), (2, 1)]
    for r in report["rows"]:
        assert r["S"] == S and r["local_tokens"] == S // r["P"] and len(r["samples"]) == 1
        assert timed(r["seconds"]) and memory(r["peak_growth_mib"])
        samples_hold(r)
    for (provider, P), e in summary.items():
        ranks = [r for r in report["rows"] if (r["provider"], r["P"]) == (provider, P)]
        assert len(ranks) == P and e["local_tokens"] == S // P
        assert e["max_rank_seconds"] == max(r["seconds"] for r in ranks)
        assert e["max_rank_peak_growth_mib"] == max(r["peak_growth_mib"] for r in ranks)
        assert e["max_rank_seconds_min"] <= e["max_rank_seconds"] <= e["max_rank_seconds_max"]
        peers = {"_vs_P1": summary[provider, 1] if provider != "single-process" else None,
                 "_vs_single_process": summary["single-process", 1]}
        for key in ("peak_growth_mib", "seconds"):
            for suffix, peer in peers.items():
                if peer is not None and peer["max_rank_" + key] > 0:
                    assert e[key + suffix] == quotient(e["max_rank_" + key], peer["max_rank_" + key])
                else:
                    assert key + suffix not in e
    assert "x single" in stdout and (report["noise_warning"] is None) == ("noise:" not in stdout)
    spreads = [bench.Spread(e["max_rank_seconds_min"], e["max_rank_seconds"], e["max_rank_seconds_max"])
               for e in summary.values()]
    assert (report["noise_warning"] is None) == all(s.relative <= bench.NOISE_LIMIT for s in spreads)


def test_trl_step_benchmark_quick(tmp_path):
    pytest.importorskip("trl", minversion="1.16")
    stdout, report = _quick("trl_step", tmp_path, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    ours, eager = report["rows"]
    lengths = report["lengths"]
    assert (ours["impl"], eager["impl"]) == ("sinkattn", "eager")
    assert ours["batch"] == [1, sum(lengths)] and eager["batch"] == [len(lengths), max(lengths)]
    for r in (ours, eager):
        assert r["tokens_in_batch"] == r["batch"][0] * r["batch"][1]
        assert timed(r["seconds"]) and len(r["samples"]) == 1 and memory(r["peak_growth_mib"])
        samples_hold(r)
        assert timed(r["first_loss"]) and r["threads"] == report["header"]["threads"]
    assert abs(ours["first_loss"] - eager["first_loss"]) < 0.05 * eager["first_loss"]   # the same tokens scored
    assert report["ratios"]["time_vs_eager"] == quotient(ours["seconds"], eager["seconds"])
    if eager["peak_growth_mib"] > 0:
        assert report["ratios"]["peak_growth_vs_eager"] == quotient(ours["peak_growth_mib"], eager["peak_growth_mib"])
    else:
        assert report["ratios"]["peak_growth_vs_eager"] is None
    assert f"sinkattn packed / eager padded: time {report['ratios']['time_vs_eager']:.3f}x" in stdout


def test_decode_benchmark_quick(tmp_path):
    pytest.importorskip("transformers", minversion="5.4")
    stdout, report = _quick("decode", tmp_path)
    calls = [r for r in report["rows"] if r["section"] == "call"]
    assert [(r["B"], r["Sk"]) for r in calls] == [(1, 16), (1, 128), (4, 16), (4, 128)]
    for r in calls:
        t = r["seconds"]
        assert all(timed(t[p]["wall"]) and memory(t[p]["cpu"]) for p in ("sinkattn", "sdpa", "eager"))
        assert r["vs_sdpa"] == quotient(t["sinkattn"]["wall"], t["sdpa"]["wall"])
        assert r["vs_sdpa_cpu"] == quotient(t["sinkattn"]["cpu"], t["sdpa"]["cpu"])
        assert r["vs_eager"] == quotient(t["sinkattn"]["wall"], t["eager"]["wall"])
        assert f"B={r['B']} Sq=1 Sk={r['Sk']}" in r["shape"] and f"vs sdpa {r['vs_sdpa']:.2f}x" in stdout
    generated = [r for r in report["rows"] if r["section"] == "generate"]
    assert [(r["model"], r["prompt"], r["new_tokens"]) for r in generated] == [
        ("tiny", 32, 2), ("tiny", 128, 2), ("gpt-oss attention", 32, 2), ("gpt-oss attention", 128, 2)]
    for r in generated:
        per_token, whole = r["seconds_per_token"], r["seconds_per_token_with_prefill"]
        (ours,) = set(per_token) - {"eager"}
        assert set(whole) == {ours, "eager"} and all(timed(x) for x in whole.values())
        assert all(timed(per_token[i]["wall"]) and memory(per_token[i]["cpu"]) for i in (ours, "eager"))
        assert r["vs_eager"] == quotient(per_token[ours]["wall"], per_token["eager"]["wall"])
        assert r["vs_eager_cpu"] == quotient(per_token[ours]["cpu"], per_token["eager"]["cpu"])
        assert r["vs_eager_with_prefill"] == quotient(whole[ours], whole["eager"])
        assert r["same_tokens"] is True and f"{r['vs_eager']:.3f}x eager" in stdout


PACKING_RATIOS = {   # section: (ours, peer, per visible pair?), as benchmarks/packing.py forms its ratios (--quick)
    "short": ("1-3 tokens", "100-156 tokens", False), "long-tailed": ("long-tailed", "uniform 128", True),
    "short-heavy": ("short-heavy", "uniform 128", True), "empty": ("with 8 empty after each", "long-tailed", False)}


def test_packing_benchmark_quick(tmp_path):
    stdout, report = _quick("packing", tmp_path)
    assert set(report["ratios"]) == {"short_fwd", "short_fwdbwd", "long-tailed_fwd", "long-tailed_fwdbwd",
                                     "short-heavy_fwd", "short-heavy_fwdbwd", "empty_fwdbwd"}
    timed_rows = [r for r in report["rows"] if r["section"] != "threshold"]
    for r in timed_rows:
        assert timed(r["seconds"]) and r["visible_pairs"] > 0 and r["nonempty"] <= r["sequences"]
        assert r["ns_per_pair"] == pytest.approx(r["seconds"] / r["visible_pairs"] * 1e9, rel=1e-9)
        assert r["nonempty"] <= r["tokens"] <= r["nonempty"] * r["longest"]
        assert r["visible_pairs"] <= r["tokens"] * r["longest"]
        if r["batch"] == "uniform 128":                            # 1024 tokens in sequences of 128
            assert (r["sequences"], r["tokens"], r["longest"]) == (8, 1024, 128)
            assert r["visible_pairs"] == 8 * 128 * 129 // 2
    row = {(r["section"], r["batch"], r["mode"]): r for r in timed_rows}
    for key, ratio in report["ratios"].items():
        section, mode = key.rsplit("_", 1)
        ours, peer, per_pair = PACKING_RATIOS[section]
        figure = "ns_per_pair" if per_pair else "seconds"
        assert ratio == quotient(row[section, ours, mode][figure], row[section, peer, mode][figure])
        assert f"= {ratio:.3f}x" in stdout
    for mode in ("fwd", "fwdbwd"):
        short, long_ = row["short", "1-3 tokens", mode], row["short", "100-156 tokens", mode]
        assert short["sequences"] == 500 and short["longest"] <= 3 and long_["longest"] <= 156
        assert short["tokens"] == long_["tokens"]                  # the same tokens in both
        assert all(r["tokens"] == 1024 for (section, _, m), r in row.items() if section != "short" and m == mode)
    padded, plain = row["empty", "with 8 empty after each", "fwdbwd"], row["empty", "long-tailed", "fwdbwd"]
    assert padded["sequences"] == 9 * plain["sequences"]
    assert [padded[k] for k in ("nonempty", "tokens", "visible_pairs")] == [plain[k] for k in
                                                                           ("sequences", "tokens", "visible_pairs")]
    cuts = [r for r in report["rows"] if r["section"] == "threshold"]
    assert [r["L"] for r in cuts] == [2, 8]
    for r in cuts:                                                 # lengths L, L+1, L, ... filling 1024 tokens
        lens = [r["L"] + i % 2 for i in range(1024 // r["L"])]
        assert r["sequences"] == len(lens) and r["visible_pairs"] == sum(L * (L + 1) // 2 for L in lens)
        assert timed(r["batched"]) and timed(r["one_call_each"])
    assert "target <= 1.2" in stdout and "[threshold]" in stdout


def test_nonfinite_benchmark_quick(tmp_path):
    stdout, report = _quick("nonfinite", tmp_path)
    rows = report["rows"]
    assert [(r["shape"].split()[5], r["mode"]) for r in rows] == [
        ("float32", "fwd"), ("float32", "fwdbwd"), ("bfloat16", "fwd"), ("bfloat16", "fwdbwd")]
    for r in rows:
        t = r["seconds"]
        assert "S=256" in r["shape"] and timed(t["checked"]) and timed(t["unchecked"]) and timed(r["check_seconds"])
        assert r["cost"] == pytest.approx(t["checked"] / t["unchecked"] - 1, rel=1e-9, abs=1e-12)
        assert r["check_share"] == quotient(r["check_seconds"], t["checked"])
        assert f"difference {r['cost'] * 100:+.2f}%" in stdout
    assert "budget < 2%" in stdout


def test_ab_benchmark_quick(tmp_path):
    """This checkout against itself as the baseline: every section is there; each ratio is the quotient of
    the two medians, each median that of its samples (one per round and repeat, or per token interval), and
    each peer ratio sinkattn's median over the peer's in the same checkout."""
    stdout, report = _quick("ab", tmp_path, "--baseline", str(ROOT))
    assert report["header"]["baseline_commit"] == report["header"]["this_commit"]
    rows = report["rows"]
    generate = "generate" not in report["skipped"]
    assert report["sections"] == ["training", "decode", "tiny", "short"] + ["generate"] * generate
    assert [(r["section"], r["case"], r["mode"]) for r in rows] == [
        ("training", case, mode) for case in ("causal S=256 D=64 fp32", "packed [96, 40, 72, 48] D=64 fp32")
        for mode in ("inference", "forward", "forward+backward")] + [
        ("decode", f"B={B} Sk={Sk} HQ=16 HKV=2 D=64 fp32", "inference") for B in (1, 4) for Sk in (16, 128)] + [
        ("tiny", "500 seqs of 1-3 tokens HQ=8 HKV=2 D=64 fp32", mode) for mode in ("inference", "forward+backward")] + [
        ("short", f"causal S={S} HQ=16 HKV=4 D=64 fp32", "inference") for S in (64, 128)] + [
        ("generate", "tiny gpt-oss, prompt 32, 4 new tokens", "per token")] * generate
    assert {r["peer"] for r in rows} == {None, "sdpa", "100-156 tokens", *["eager"] * generate}
    lines = stdout.splitlines()
    legend = lines.index(next(x for x in lines if x.startswith("section ")))
    assert "this / baseline" in lines[legend - 1] and "base/peer" in lines[legend] and "this/peer" in lines[legend]
    for r, printed in zip(rows, lines[legend + 1:]):
        for tree in ("baseline", "this"):
            per_run = 3 if r["section"] == "generate" else 1        # generate: the intervals between 4 tokens
            assert len(r["samples"][tree]) == report["rounds"] * report["repeats"] * per_run
            samples_hold(dict(seconds=r["seconds"][tree], samples=r["samples"][tree]))
            if r["peer"]:
                assert len(r["peer_samples"][tree]) == len(r["samples"][tree])
                samples_hold(dict(seconds=r["peer_seconds"][tree], samples=r["peer_samples"][tree]))
                assert r["peer_ratio"][tree] == quotient(r["seconds"][tree], r["peer_seconds"][tree])
        assert r["ratio"] == quotient(r["seconds"]["this"], r["seconds"]["baseline"])
        assert printed.startswith(r["section"]) and r["case"] in printed and f"{r['ratio']:9.2f}" in printed
        if r["peer"]:
            assert f"{r['peer_ratio']['baseline']:9.2f} {r['peer_ratio']['this']:9.2f}" in printed
            assert f"<= {r['target']:.2f}" in printed if r["target"] else printed.endswith("-")
    assert [r["target"] for r in rows if r["section"] == "decode"] == [3.0, None] * 2


def test_ab_benchmark_only_times_the_sections_asked_for(tmp_path):
    stdout, report = _quick("ab", tmp_path, "--baseline", str(ROOT), "--only", "short", "decode")
    assert report["sections"] == ["decode", "short"] and report["skipped"] == {}
    assert [r["section"] for r in report["rows"]] == ["decode"] * 4 + ["short"] * 2
    assert not any(x.startswith(("training", "tiny", "generate")) for x in stdout.splitlines())


def test_ab_benchmark_refuses_a_baseline_that_is_not_a_checkout(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab.py"), "--baseline", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "has no src/sinkattn" in run.stderr


def test_cache_memory_benchmark_quick(tmp_path):
    stdout, result = _quick("cache_memory", tmp_path, "--threads", "1")
    assert (result["calls"], result["max_len"], result["window"], result["threads"]) == (20, 512, [2047, 2047], 1)
    assert [i for i, _ in result["trace"]] == [0, 10, 20]          # after the warm-up, then every 10 calls
    assert all(timed(rss) for _, rss in result["trace"])
    assert (result["rss_start_mib"], result["rss_end_mib"]) == (result["trace"][0][1], result["trace"][-1][1])
    assert result["growth_mib"] == pytest.approx(result["rss_end_mib"] - result["rss_start_mib"], abs=1e-9)
    assert f"growth over 20 calls with new lengths, window (2047, 2047): {result['growth_mib']:.1f} MiB" in stdout


def test_cpu_bf16_operands_are_what_the_compensated_figures_say():
    """``compensated.py --backend cpu`` hands the tiles bf16 operands: plain ones cost Gate A on a batch
    of its table (seed 2: dv), the compensated split does not, and the backend's own products return."""
    script = runpy.run_path(str(ROOT / "benchmarks" / "compensated.py"))
    own = cpu_tiles.block_products, cpu_tiles._pv
    case = cases.random_packed(2, dtype=torch.bfloat16, **script["CPU_SIZES"])
    with script["_cpu_bf16_operands"](False):
        plain = verify.run_case(case, "cpu")
    with script["_cpu_bf16_operands"](True):
        compensated = verify.run_case(case, "cpu")
    assert not plain.passed and [r.name for r in plain.reports if not r.accepted] == ["dv"]
    assert compensated.passed
    assert (cpu_tiles.block_products, cpu_tiles._pv) == own and verify.run_case(case, "cpu").passed
