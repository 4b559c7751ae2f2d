"""The ``sinkattn`` command end to end on tiny shapes: tables, JSON with every figure, exit codes."""

import argparse
import contextlib
import io
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sinkattn import __main__ as cli
from sinkattn.backends import cpu
from sinkattn.testing import bench, precision

# pytest -n: one worker runs the whole module, whose module-scoped fixture launches processes
pytestmark = pytest.mark.xdist_group("test_cli")


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """``python -m sinkattn`` (the main job: verify L0 with determinism over 3 runs, then the default bench)
    run once, in process: ``(exit code, printed text, output folder)``. The bench's default configuration
    keeps its first two lengths (S = 256, 512): the longer ones add 40 s of the same code."""
    folder = tmp_path_factory.mktemp("main-job")
    before, columns = Path.cwd(), os.environ.get("COLUMNS")
    default = bench.CONFIGS["cpu-default"]
    os.environ["COLUMNS"] = "130"
    os.chdir(folder)
    bench.CONFIGS["cpu-default"] = default[:2]
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            code = cli.main([])
    finally:
        bench.CONFIGS["cpu-default"] = default
        os.chdir(before)
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    return code, printed.getvalue(), folder / "sinkattn-out"


def test_verify_passes_and_json_holds_the_table(main_job):
    code, text, folder = main_job
    out = folder / "verify.json"
    assert code == 0
    assert "verdict: PASS: 8 of 8" in text
    assert "A ratio: share within Gate A's tolerance (pass >= 0.99); B factor: max err / eager's" in text  # legend
    assert "A, B: the gates' verdicts; det: outputs and gradients bitwise equal over the runs" in text
    assert "peak MiB: the call's peak memory growth" in text
    written = re.findall(r"^(table|plot) written to (\S+)$", text, flags=re.M)
    assert [(kind, Path(path).name) for kind, path in written] == [
        ("table", "verify.json"), ("table", "bench.json"), ("plot", "bench.png")]
    assert all((folder.parent / path).is_file() for _, path in written)
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
            _gates_follow_from_the_figures(r)
        assert case["passed"] == _case_passes(case)
    assert data["passed"] == all(case["passed"] for case in data["cases"])


def _gates_follow_from_the_figures(r: dict) -> None:
    """Each gate's verdict is what docs/contract.md §4 makes of the tensor's own figures."""
    tol = precision.TOLERANCES[getattr(torch, r["dtype"])]
    assert 0 <= r["ratio"] <= 1 and r["max_abs_err"] >= 0 and r["rms_rel_err"] >= 0, r
    assert r["gate_a"] == (r["special_ok"] and r["ratio"] >= tol.required_ratio
                           and r["max_abs_err"] <= tol.max_abs_limit), r
    if r["gate_b"] is not None:
        factor = precision.GATE_B_FACTOR["output" if r["name"] in ("o", "lse") else "gradient"]
        assert r["gate_b_factor"] >= 0 and r["gate_b"] == (r["gate_b_factor"] <= factor), r


def _case_passes(case: dict) -> bool:
    accepted = all(r["gate_a"] or (r["waiver"] is not None and bool(r["waiver_ok"])) for r in case["reports"])
    return case["error"] is None and case["deterministic"] is not False and accepted


def test_verify_fails_with_nonzero_exit_on_a_wrong_backend(tmp_path, monkeypatch, capsys):
    real = cpu.forward

    def off_by_a_bit(*args, **kwargs):
        result = real(*args, **kwargs)
        return result._replace(o=result.o * 1.01)
    monkeypatch.setattr(cpu, "forward", off_by_a_bit)
    out = tmp_path / "v.json"
    code = cli.main(["verify", "--level", "L0", "--backend", "cpu", "--repeats", "1", "--no-gate-b",
                     "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    assert "verdict: FAIL" in text
    # --repeats 1: determinism is not checked, and the output says so
    assert "determinism not checked (--repeats 1)" in text
    data = json.loads(out.read_text())
    assert data["determinism_checked"] is False and all(c["deterministic"] is None for c in data["cases"])
    assert data["passed"] is False and not all(c["passed"] for c in data["cases"])
    for case in data["cases"]:
        for r in case["reports"]:
            _gates_follow_from_the_figures(r)
        assert case["passed"] == _case_passes(case)
        by = {r["name"]: r for r in case["reports"]}
        assert by["lse"]["gate_a"] is True            # the forward's lse is untouched; its output is 1% off
        assert by["o"]["gate_a"] is False and by["o"]["max_abs_err"] > 0


def test_bench_writes_json_with_every_figure_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = cli.main(["bench", "--config", "cpu-quick", "--modes", "fwd,bwd,fwdbwd", "--repeats", "2",
                     "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert code == 0 and png.stat().st_size > 10_000
    data = json.loads(out.read_text())
    assert {"machine", "isa", "torch", "sinkattn", "commit", "threads"} <= set(data["header"])
    rows = data["rows"]
    providers, modes = ("sinkattn", "sdpa", "sdpa_lse", "eager"), ("fwd", "bwd", "fwdbwd")
    assert sorted((r["problem"]["S"], r["provider"], r["mode"]) for r in rows) == sorted(
        (p.S, provider, mode) for p in bench.CONFIGS["cpu-quick"] for provider in providers for mode in modes)
    for r in rows:
        assert r["ms"] > 0 and r["gflops"] > 0
        assert 0 < r["ms_min"] <= r["ms"] <= r["ms_max"] and all(map(math.isfinite, (r["ms_min"], r["ms_max"])))
        assert f"{r['ms']:.2f}" in text and f"{r['ms_min']:.2f}–{r['ms_max']:.2f}" in text
        _rate_and_ratio_follow_from_the_times(r, rows)
        assert r["peak_mem_mib"] is None or r["peak_mem_mib"] >= 0
        if r["provider"] == "sinkattn":
            assert r["vs_best_peer"] > 0 and f"{r['vs_best_peer']:.2f}x" in text
    assert all(f" {words} " in text for words in ("forward", "backward", "forward+backward"))
    assert data["repeats"] == 2 and data["noise_limit"] == 0.2
    assert (data["noise_warning"] is None) == ("noise:" not in text)
    noisy = [r for r in rows if (r["ms_max"] - r["ms_min"]) / r["ms"] > data["noise_limit"]]
    assert (data["noise_warning"] is None) == (not noisy)
    if noisy:
        assert data["noise_warning"].startswith(f"noise: {len(noisy)} of {len(rows)} timings spread more than 20%")


def _rate_and_ratio_follow_from_the_times(row: dict, rows: list[dict]) -> None:
    """A row's GFLOP/s is its problem's visible-pair FLOPs over its median; sinkattn's ``vs_best_peer`` is the
    fastest peer's median over its own, on the same problem and mode."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in row["problem"].items() if k != "label"}
    problem = bench.Problem(**fields)
    assert problem.label == row["problem"]["label"]
    assert row["gflops"] == pytest.approx(problem.flops(row["mode"]) / (row["ms"] * 1e-3) / 1e9, rel=1e-9)
    peers = [r["ms"] for r in rows if r["problem"] == row["problem"] and r["mode"] == row["mode"]
             and r["provider"] != "sinkattn" and r["ms"] is not None]
    if row["provider"] == "sinkattn":
        assert row["vs_best_peer"] == (pytest.approx(min(peers) / row["ms"], rel=1e-9) if peers else None)
    else:
        assert row["vs_best_peer"] is None


def test_bench_shape_and_window(tmp_path):
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--shape", "1,96,4,2,16", "--window", "31,0", "--modes", "fwd",
                     "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    by = {r["provider"]: r for r in rows}
    assert by["sinkattn"]["ms"] > 0 and by["eager"]["ms"] > 0
    assert by["sdpa"]["ms"] is None and "window" in by["sdpa"]["note"]
    assert by["sdpa"]["gflops"] is None and by["sdpa"]["vs_best_peer"] is None
    for r in (by["sinkattn"], by["eager"]):
        assert r["problem"]["window"] == [31, 0] and (r["problem"]["S"], r["problem"]["HQ"]) == (96, 4)
        _rate_and_ratio_follow_from_the_times(r, rows)


def test_bench_threads_sets_torch_threads_and_refuses_zero_and_more_than_the_cpus(tmp_path, capsys):
    out = tmp_path / "b.json"
    before = torch.get_num_threads()
    try:
        assert cli.main(["bench", "--shape", "1,32,4,2,16", "--modes", "fwd", "--providers", "sinkattn",
                         "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
        assert json.loads(out.read_text())["header"]["threads"] == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    cpus = os.cpu_count()
    for bad in (0, cpus + 1, 1000 * cpus):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "--threads", str(bad)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"argument --threads: must be from 1 to {cpus} (this machine's CPUs), got {bad}" in err
    assert cli._parser().parse_args(["bench", "--threads", str(cpus)]).threads == cpus


def test_module_entry_point_help():
    run = subprocess.run([sys.executable, "-m", "sinkattn", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "verify" in run.stdout and "bench" in run.stdout


def test_importing_sinkattn_leaves_dynamo_unloaded():
    """Dynamo costs about a second to import: a process that only imports sinkattn (a CLI's --help or
    bad value) does not pay for it; the first custom-op call or compile loads it."""
    code = "import sys, sinkattn, sinkattn.hf; print('torch._dynamo' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stdout + run.stderr[-2000:]



# --- every option checked before any work ------------------------------------------------------------------------

BAD_VALUES = [   # (arguments, the option the one-line error must name): each in its own `python -m sinkattn`
    (["bench", "--shape", "1,256"], "--shape"),
    (["bench", "--device", "cuda"], "--device"),                   # the subprocess sees no GPU
    (["verify", "--backend", "triton"], "--backend"),              # no GPU, no TRITON_INTERPRET=1
]
MORE_BAD_VALUES = [   # the same checks, more of their branches, in this process
    (["bench", "--shape", "1,-128,4,1,64"], "--shape"),
    (["bench", "--shape", "1,64,6,4,16"], "--shape"),              # HQ not a multiple of HKV
    (["bench", "--shape", "1,64,4,2,600"], "--shape"),             # D beyond every backend
    (["bench", "--shape", "1,64,4,2,16", "--window", "63"], "--window"),
    (["bench", "--window", "7,3"], "--window"),                    # right > 0 on causal attention
    (["bench", "--modes", "fwd,backward"], "--modes"),
    (["bench", "--providers", "sinkattn,foo"], "--providers"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--providers", "sdpa,eager"], "--providers"),       # nothing of ours would run
    (["bench", "--json", "{missing}/b.json"], "--json"),
    (["bench", "--plot", "{missing}/b.png"], "--plot"),
    (["bench", "--config", "cpu-quick", "--shape", "1,64,4,2,16"], "--shape"),
    (["verify", "--repeats", "-1"], "--repeats"),
    (["verify", "--json", "{missing}/v.json"], "--json"),
    (["bench", "--shape", "1,100000000,64,8,256"], "--shape"),     # far beyond this machine's memory
    (["bench", "--shape", "1,64,4,2,0"], "--shape"),
    (["bench", "--shape", "1,64,4.0,2,16"], "--shape"),
    (["bench", "--window", "7,-2"], "--window"),
    (["bench", "--window", "a,b"], "--window"),
    (["bench", "--modes", "fwd,"], "--modes"),
    (["bench", "--repeats", "x"], "--repeats"),
    (["bench", "--threads", "100000"], "--threads"),
    (["bench", "--threads", "two"], "--threads"),
    (["bench", "--plot", "{out}/b.txt"], "--plot"),
    (["bench", "--json", "{out}"], "--json"),
    (["bench", "--json", "/proc/b.json"], "--json"),               # a folder that exists but takes no files
    (["bench", "--plot", "/proc/b.png"], "--plot"),
    (["--out", "/proc/sinkattn-out"], "--out"),
    (["bench", "--dtype", "fp8"], "--dtype"),
    (["verify", "--repeats", "0"], "--repeats"),
    (["verify", "--dtype", "half"], "--dtype"),
    (["verify", "--level", "L9"], "--level"),
    (["--out", "{out}/o", "verify"], "--out"),
    (["--out", "{out}/a-file"], "--out"),
    (["bench", "--config", "gpu-default", "--device", "cpu"], "--config"),
    (["bench", "--config", "gpu-targets", "--device", "cpu"], "--config"),
]


def _completed(argv, out):
    """Fill in every option the case does not test with a cheap valid value, so that a CLI that does the
    work before checking the bad one would write the JSON/PNG under ``out`` and print its table."""
    argv = [a.format(out=out, missing=out / "missing") for a in argv]
    extra = []
    if argv[0] == "bench":
        if "--shape" not in argv and "--config" not in argv:
            extra += ["--config", "cpu-quick"]
        extra += [] if "--modes" in argv else ["--modes", "fwd"]
        extra += [] if "--plot" in argv else ["--plot", str(out / "b.png")]
    if argv[0] == "verify":
        extra += ["--no-gate-b"]
    if argv[0] in ("bench", "verify"):
        extra += [] if "--repeats" in argv else ["--repeats", "1"]
        extra += [] if "--json" in argv else ["--json", str(out / f"{argv[0]}.json")]
    return argv + extra


def _no_work_done(out) -> list[str]:
    return sorted(p.name for p in out.rglob("*") if p.name != "a-file")


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every BAD_VALUES case through ``python -m sinkattn`` in its own fresh process, four at a time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}

    def one(i):
        out = tmp_path_factory.mktemp(f"bad{i}")
        (out / "a-file").write_text("")
        argv = _completed(BAD_VALUES[i][0], out)
        run = subprocess.run([sys.executable, "-m", "sinkattn", *argv], capture_output=True, text=True, env=env,
                             cwd=out, timeout=600)
        return run, _no_work_done(out)
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return list(pool.map(one, range(len(BAD_VALUES))))


@pytest.mark.parametrize("i", range(len(BAD_VALUES)), ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_a_bad_value_is_a_one_line_error_before_any_work(bad_runs, i):
    run, written = bad_runs[i]
    option = BAD_VALUES[i][1]
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert len(lines) == 1 and f"argument {option}:" in lines[0], run.stderr
    assert run.stdout == "" and written == [], (run.stdout[-500:], written)   # no table, no JSON, no PNG


@pytest.mark.parametrize("argv,option", MORE_BAD_VALUES, ids=[" ".join(a) for a, _ in MORE_BAD_VALUES])
def test_more_bad_values_in_process(tmp_path, capsys, monkeypatch, argv, option):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        cli.main(_completed(argv, tmp_path))
    err = capsys.readouterr()
    assert exit_.value.code == 2
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and f"argument {option}:" in lines[0], err.err
    assert err.out == "" and _no_work_done(tmp_path) == []


@pytest.mark.parametrize("text,window", [("-1,0", (-1, 0)), ("-1,-1", (-1, -1)), ("7,-1", (7, -1))])
def test_a_window_with_a_leading_minus_is_a_value_not_an_option(text, window):
    assert cli._parser().parse_args(["bench", "--no-causal", "--window", text]).window == window
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["bench", "-1"])         # still no positional arguments


@pytest.mark.parametrize("spellings", [("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32")])
@pytest.mark.parametrize("command", ["verify", "bench"])
def test_both_dtype_spellings_everywhere(command, spellings):
    parsed = [cli._parser().parse_args([command, "--dtype", s]).dtype for s in (*spellings, spellings[0].upper())]
    assert parsed == [getattr(torch, spellings[1])] * 3


def test_bench_with_a_short_dtype_spelling_runs_that_dtype(tmp_path):
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--shape", "1,32,2,1,16", "--dtype", "bf16", "--modes", "fwd", "--repeats", "1",
                     "--providers", "sinkattn", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["problem"]["dtype"] == "bfloat16" and "bfloat16" in row["problem"]["label"] and row["ms"] > 0


def test_window_applies_to_a_config_and_titles_say_it(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert cli.main(["bench", "--config", "cpu-quick", "--window", "7,0", "--modes", "fwd", "--repeats", "1",
                     "--providers", "sinkattn,eager", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert "causal w7_0" in data["setting"] and "causal w7_0" in data["title"] and "causal w7_0" in text
    assert png.stat().st_size > 10_000
    assert len(data["rows"]) == 4
    for r in data["rows"]:
        assert r["problem"]["window"] == [7, 0] and r["problem"]["causal"] is True and r["ms"] > 0


def test_no_causal_lets_the_window_have_a_right_side(tmp_path):
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--shape", "1,48,2,1,16", "--no-causal", "--window", "7,3", "--modes", "fwd",
                     "--repeats", "1", "--providers", "sinkattn,eager", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "non-causal w7_3" in data["setting"]
    for r in data["rows"]:
        assert r["problem"]["window"] == [7, 3] and r["problem"]["causal"] is False and r["ms"] > 0


def test_bench_exits_nonzero_when_sinkattn_fails(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise RuntimeError("deliberate failure of the cpu backward")
    monkeypatch.setattr(cpu, "backward", refuse)     # the real CLI path, a backend entry that raises
    out = tmp_path / "b.json"
    code = cli.main(["bench", "--shape", "1,32,2,1,16", "--modes", "fwd,fwdbwd", "--repeats", "1",
                     "--providers", "sinkattn,eager", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    assert "sinkattn failed on 1 of 2" in text and "deliberate failure" in text
    data = json.loads(out.read_text())
    assert data["sinkattn_failed"] == 1
    by = {(r["provider"], r["mode"]): r for r in data["rows"]}
    assert by["sinkattn", "fwd"]["ms"] > 0 and by["sinkattn", "fwdbwd"]["ms"] is None
    assert by["eager", "fwdbwd"]["ms"] > 0


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("backend,on_gpu", [(None, ("cuda", "triton")), ("cpu", ("cpu", "cpu")),
                                            ("reference", ("cuda", "reference"))])
def test_verify_defaults_to_the_device_present(monkeypatch, gpu, backend, on_gpu):
    """Options only (no run): on a machine with a GPU, verify's tensors are CUDA tensors and auto is triton."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    args = cli._parser().parse_args(["verify"] + (["--backend", backend] if backend else []))
    cli.check_verify(args.parser, args)
    expected = on_gpu if gpu else ("cpu", backend or "cpu")
    assert (args.device, args.runs_on) == expected


def _sigint_at_its_default():
    """Run in the child before exec: SIGINT at its default action, as in a terminal. A shell without job control
    starts a background job with SIGINT ignored, an ignored signal stays ignored through fork and exec, and a
    Python started so installs no KeyboardInterrupt handler: under such a test run the bench never saw the
    SIGINT and ran on (to its end and exit 0 when it was short enough, past the wait below when not)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_keyboard_interrupt_is_a_short_message_and_exit_130():
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    # 10^6 repeats of each length: no machine ends this before the signal, so a SIGINT that goes unseen shows as
    # the timeout below (with every thread's stack), never as a run that finished
    proc = subprocess.Popen([sys.executable, "-m", "sinkattn", "bench", "--config", "cpu-default", "--modes", "fwd",
                             "--repeats", "1000000", "--providers", "sinkattn"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_sigint_at_its_default)
    try:
        assert proc.stdout.readline().startswith("bench:")     # options checked, the timing under way
        time.sleep(0.5)
        assert proc.poll() is None, "the bench ended before the signal"
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:       # hung: SIGABRT makes faulthandler print every thread's stack
            proc.send_signal(signal.SIGABRT)
            pytest.fail("no exit within 120 s of SIGINT; stacks:\n" + proc.communicate(timeout=30)[1][-4000:])
    finally:
        proc.kill()
    # 130, or death by SIGINT (-2 here, 130 in a shell's $?): under `python -m`, CPython sometimes ends a run by
    # SIGINT after the CLI caught the interrupt and returned 130 (seen in about 1 of 3 runs on the CI machine)
    assert proc.returncode in (130, -signal.SIGINT) and err.strip() == "sinkattn: interrupted", err[-2000:]


def test_help_names_pages_that_exist_and_every_option(capsys):
    helps = []
    for argv in (["--help"], ["verify", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 0
        helps.append(capsys.readouterr().out)
    root = Path(__file__).resolve().parents[1]
    named = {page for h in helps for page in re.findall(r"docs/[\w-]+\.md", h)}
    assert "docs/contract.md" in named and all((root / page).is_file() for page in named), named
    usage = helps[0].split("\n\n")[0]                          # the synopsis names every option of the main job
    main_options = {o for a in cli._parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert all(o in usage for o in main_options), (main_options, usage)


# reStructuredText that a terminal shows as is: ``literal``, :role:`x`, `link`_, .. directive::
RST_MARKUP = re.compile(r"``|:[a-z]+:`|`_|^\s*\.\. \w+::", re.MULTILINE)


def test_rst_markup_pattern_finds_what_a_docstring_carries():
    for text in ("see ``sinkattn.testing.bench``", "see :func:`sink_attn_func`", "`docs`_", "  .. note::"):
        assert RST_MARKUP.search(text), text
    assert not RST_MARKUP.search("sinkattn verify [--level L0] (see sinkattn.testing.bench), docs/contract.md §5")


def test_help_of_every_command_is_plain_text(capsys):
    subparsers = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = sorted(subparsers.choices)
    assert commands == ["bench", "verify"]
    for argv in (["--help"], *([c, "--help"] for c in commands)):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith("usage: sinkattn"), argv
        found = [m.group(0) for m in RST_MARKUP.finditer(text)]
        assert not found, f"sinkattn {' '.join(argv)}: reStructuredText markup {found} in\n{text}"


def _skeleton(line: str) -> str:
    """A line of output with its figures (and the commit hash) blanked, whitespace collapsed."""
    line = re.sub(r"commit=\w+", "commit=#", line)
    return " ".join(re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", line).split())


def test_documented_sample_output_is_what_the_main_job_prints_now(main_job):
    """The titles, verdict, bench header keys and footnotes of docs/cli.md's sample of ``python -m sinkattn``
    are what the current code prints (its figures differ from run to run, its words must not)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    sample = re.search(r"^```\n\$ python -m sinkattn\n(.*?)^```", page, flags=re.S | re.M).group(1).splitlines()
    code, printed, _ = main_job
    assert code == 0
    words = {_skeleton(line) for line in printed.splitlines()}
    checked = [line for line in sample if re.match(r"\s*(sinkattn verify:|sinkattn bench:|ms: median|verdict:|\[\d\]|"
                                                   r"plot written|┃ case|┃ B |A ratio:)", line)]
    assert len(checked) == 10, checked
    assert [line for line in checked if _skeleton(line) not in words] == []
    keys = [re.findall(r"(\w+)=", " ".join(_before_noise(lines))) for lines in (sample, printed.splitlines())]
    assert keys[0] == keys[1] and "isa" in keys[0]


def _before_noise(lines):
    """The lines before the ``noise:`` warning, which only a noisy run prints (rich wraps it at spaces)."""
    return list(itertools.takewhile(lambda line: not line.startswith("noise:"), lines))


def _rows(spreads):
    """Bench rows with made-up times (what ``plot`` and ``noise_warning`` read), one per ``(provider, mode, S,
    (min, median, max), note)``."""
    return [bench.Row(bench.Problem(1, S, 4, 2, 16), provider, mode, ms=t[1], ms_min=t[0], ms_max=t[2], note=note)
            for provider, mode, S, t, note in spreads]


def test_noise_warning_names_the_widest_spread_and_suggests_a_rerun():
    quiet = _rows([("sinkattn", "fwd", 64, (1.0, 1.1, 1.2), ""), ("sdpa", "fwd", 64, (2.0, 2.0, 2.0), "")])
    assert bench.noise_warning((r.where, r.spread) for r in quiet) is None       # 18% of the median: no warning
    noisy = quiet + _rows([("eager", "fwdbwd", 128, (1.0, 2.0, 3.0), ""), ("sdpa", "bwd", 64, (1.0, 1.0, 1.3), "")])
    line = bench.noise_warning((r.where, r.spread) for r in noisy)
    assert line.startswith("noise: 2 of 4 timings spread more than 20%")
    assert "widest: eager forward+backward B=1 S=128, 100%" in line and "rerun" in line


@pytest.mark.parametrize("ext,magic", [("png", b"\x89PNG"), ("jpg", b"\xff\xd8"), ("svg", b"<?xml")])
def test_plot_reads_in_words_and_shows_caveats_spread_and_noise(tmp_path, ext, magic):
    providers = (("sinkattn", ""), ("sdpa", "no sinks"), ("sdpa_lse", "backward misses the lse path"))
    rows = _rows([(p, m, S, (1.0 * S, 1.1 * S, 1.2 * S), note) for m in ("fwd", "bwd", "fwdbwd") for S in (64, 128)
                  for p, note in providers])
    rows += _rows([("eager", "fwdbwd", 128, (1.0, 5.0, 9.0), "")])
    path = tmp_path / f"b.{ext}"
    drawn = bench.plot(rows, str(path), "title")
    assert path.read_bytes().startswith(magic)                    # the format of the extension
    assert list(drawn) == ["forward", "backward", "forward+backward", "noise"]
    assert drawn["forward"] == ["sinkattn", "sdpa (no sinks)", "sdpa_lse (backward misses the lse path)"]
    assert "eager" in drawn["forward+backward"]
    assert drawn["noise"] and "widest: eager forward+backward" in drawn["noise"][0]


def test_an_unknown_option_before_the_command_is_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--outt", "x"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "unrecognized arguments: --outt" in err and "invalid choice" not in err
    assert cli._unknown_option(cli._parser(), ["--ou", "d", "bench", "--bad"]) is None   # a prefix; after the command


def test_without_matplotlib_the_default_run_skips_the_plot_and_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)         # import matplotlib fails, find_spec finds nothing
    steps = cli._default_steps(cli._parser(), str(tmp_path))
    err = capsys.readouterr().err
    assert [s.command for s in steps] == ["verify", "bench"] and steps[1].plot is None
    assert "pip install rich matplotlib" in err and 'pip install "sinkattn[cli]"' in err and "--plot" not in err
    assert "source tree" not in err          # the hint works for a wheel install too
    with pytest.raises(SystemExit):                              # asked for by name, --plot is refused before work
        cli.main(["bench", "--shape", "1,32,2,1,16", "--plot", str(tmp_path / "b.png")])
    err = capsys.readouterr().err
    assert "argument --plot: plots need matplotlib" in err and "pip install rich matplotlib" in err


def test_bench_header_says_triton_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    assert bench.header()["triton"] == "not installed"
