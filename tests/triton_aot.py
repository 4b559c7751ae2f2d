"""The recorded resource audit is current, and the hardest configurations still build as recorded.

Run as a script, outside the interpreter (``TRITON_INTERPRET`` unset: the interpreter accepts code
the GPU compiler rejects, and its kernels cannot be compiled for a GPU):

1. every configuration the backend can choose today (``triton_audit.configs()``) has an entry in
   ``benchmarks/results/triton-audit.json`` whose key matches: same kernel source, launch
   signature, constexprs, tile and arch, with the record's Triton and ptxas versions. A kernel or
   table change without a rerun of the audit fails here, whatever Triton is installed;
2. the hardest entry of each chip (most registers, then most shared memory, among fp16 / bf16)
   is compiled again for its chip. With the record's Triton and ptxas its shared memory,
   registers, stack and spills must equal the recorded ones; with another Triton (a fresh install
   takes the newest) they must keep within the limits (``triton_audit.problems``), and the output
   says the record is for another toolchain.

Prints one ``compiled`` line per live compile; exits non-zero on any failure.
"""

import concurrent.futures
import json
import multiprocessing
import sys
import time
from pathlib import Path

from harness import triton_audit as audit

RECORD = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "triton-audit.json"
FIGURES = ("shared_bytes", "registers", "stack_bytes", "spill_stores", "spill_loads")
RERUN = f"PYTHONPATH=tests python -m harness.triton_audit --reuse {RECORD} --out {RECORD} --markdown"


def stale(record: dict) -> list[str]:
    tools = record["toolchain"] | dict(kernels_sha256=audit.toolchain()["kernels_sha256"])
    entries = {e["name"]: e for e in record["entries"]}
    out = []
    for cfg in audit.configs():
        entry = entries.get(cfg.name)
        if entry is None:
            out.append(f"{cfg.name}: not in the record")
        elif entry["key"] != audit.entry_key(cfg, tools):
            out.append(f"{cfg.name}: changed since it was recorded (kernel source, table or launch arguments)")
    return out


def hardest(record: dict) -> list[audit.Config]:
    picked = {}
    for e in record["entries"]:
        if e["config"]["dtype"] == "float32" or e["error"]:
            continue
        best = picked.get(e["config"]["chip"])
        if best is None or (e["registers"], e["shared_bytes"]) > (best["registers"], best["shared_bytes"]):
            picked[e["config"]["chip"]] = e
    return [audit.Config(**e["config"]) for e in picked.values()]


def main() -> int:
    record = json.loads(RECORD.read_text())
    problems = stale(record)
    if problems:
        print(f"{len(problems)} configurations differ from {RECORD.name}; rerun: {RERUN}")
        print("\n".join(f"  {p}" for p in problems[:20]))
        return 1
    print(f"{len(record['entries'])} recorded configurations match the code")
    entries = {e["name"]: e for e in record["entries"]}
    tools = audit.toolchain()
    recorded = record["toolchain"]
    same_tools = (tools["triton"], tools["ptxas"]) == (recorded["triton"], recorded["ptxas"])
    if not same_tools:
        print(f"the record is for Triton {recorded['triton']} (ptxas {recorded['ptxas']}), this is Triton "
              f"{tools['triton']} (ptxas {tools['ptxas']}): live compiles held to the limits only; rerun: {RERUN}")
    failed = 0
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for live in pool.map(audit.compile_config, hardest(record), [tools] * 8):
            want = entries[live.name]
            got = {f: getattr(live, f) for f in FIGURES}
            if same_tools:
                ok = live.error is None and got == {f: want[f] for f in FIGURES}
                verdict = "matches the record" if ok else "DIFFERS from " + str({f: want[f] for f in FIGURES})
            else:
                found = audit.problems([live])
                ok = not found
                verdict = "within the limits" if ok else "; ".join(found)
            failed += not ok
            print(f"compiled {live.name}: {got} {verdict}" + (f" ({live.error})" if live.error else ""), flush=True)
    print(f"live compiles: {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
