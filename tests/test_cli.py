"""The ``sinkattn`` command end to end on tiny shapes: tables, JSON with every figure, exit codes."""

import json
import subprocess
import sys

from sinkattn import __main__ as cli
from sinkattn.backends import cpu


def test_verify_passes_and_json_holds_the_table(tmp_path, capsys):
    out = tmp_path / "verify.json"
    code = cli.main(["verify", "--level", "L0", "--backend", "cpu", "--repeats", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "verdict: PASS: 8 of 8" in text
    data = json.loads(out.read_text())
    assert data["passed"] is True and len(data["cases"]) == 8
    for case in data["cases"]:
        assert case["deterministic"] is True
        names = [r["name"] for r in case["reports"]]
        assert names == ["o", "lse", "dq", "dk", "dv", "dsinks"]
        for r in case["reports"]:
            for key in ("ratio", "max_abs_err", "gate_a", "gate_b_factor", "gate_b", "rms_rel_err"):
                assert r[key] is not None, key
            assert f"{r['ratio']:.4f}" in text


def test_verify_fails_with_nonzero_exit_on_a_wrong_backend(tmp_path, monkeypatch, capsys):
    real = cpu.forward

    def off_by_a_bit(*args, **kwargs):
        out, lse, extra = real(*args, **kwargs)
        return out * 1.01, lse, extra
    monkeypatch.setattr(cpu, "forward", off_by_a_bit)
    code = cli.main(["verify", "--level", "L0", "--backend", "cpu", "--repeats", "1", "--no-gate-b"])
    assert code == 1
    assert "verdict: FAIL" in capsys.readouterr().out


def test_bench_writes_json_with_every_figure_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = cli.main(["bench", "--config", "cpu-quick", "--modes", "fwd,bwd,fwdbwd", "--repeats", "2",
                     "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert code == 0 and png.stat().st_size > 10_000
    data = json.loads(out.read_text())
    assert {"machine", "torch", "sinkattn", "commit", "threads"} <= set(data["header"])
    rows = data["rows"]
    assert {(r["provider"], r["mode"]) for r in rows} >= {(p, m) for p in ("sinkattn", "sdpa", "sdpa_lse", "eager")
                                                         for m in ("fwd", "bwd", "fwdbwd")}
    for r in rows:
        assert r["ms"] > 0 and r["gflops"] > 0
        assert f"{r['ms']:.2f}" in text
        if r["provider"] == "sinkattn":
            assert r["vs_best_peer"] > 0 and f"{r['vs_best_peer']:.2f}x" in text


def test_bench_shape_and_window(tmp_path):
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--shape", "1,96,4,2,16", "--window", "31,0", "--modes", "fwd",
                     "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    by = {r["provider"]: r for r in rows}
    assert by["sinkattn"]["ms"] > 0 and by["eager"]["ms"] > 0
    assert by["sdpa"]["ms"] is None and "window" in by["sdpa"]["note"]


def test_module_entry_point_help():
    run = subprocess.run([sys.executable, "-m", "sinkattn", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "verify" in run.stdout and "bench" in run.stdout

