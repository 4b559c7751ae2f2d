"""What ``python -m build`` makes of the repository: the sdist and the wheel carry the package, its licence
and metadata, and nothing else (no test harness: it lives in tests/harness, and the installed package
imports without it); the torch floor is one version in pyproject, the README and .ci/floor."""

import ast
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import sinkattn

# pytest -n: one worker runs the whole module, whose module-scoped fixture launches processes
pytestmark = pytest.mark.xdist_group("test_packaging")

ROOT = Path(__file__).resolve().parents[1]
TESTING = {"__init__", "precision", "cases", "verify", "eager", "bench", "flops", "options"}
"""``sinkattn.testing``'s modules: what users call in their own tests (the precision gates, the level tables,
the float64 golden) and what the ``sinkattn`` command runs (``verify``, ``bench`` and their options)."""
HARNESS = {p.stem for p in (ROOT / "tests" / "harness").glob("*.py")} - {"__init__"}
"""The test harness's modules (tests/harness): launchers, audits, test models; never shipped."""
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
"""The Apache License 2.0 as published (apache.org's LICENSE-2.0.txt, Debian's common-licenses/Apache-2.0)."""


def _sources() -> set[str]:
    """The package's modules and the compiled kernel's source, relative to src/: ``sinkattn/...py``."""
    package = ROOT / "src" / "sinkattn"
    return {p.relative_to(ROOT / "src").as_posix() for p in (*package.rglob("*.py"), *package.rglob("*.cpp"))}


def _pyproject_floor() -> str:
    deps = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S).group(1)
    return re.fullmatch(r'"torch>=(\d+\.\d+)"', deps.strip()).group(1)


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """``(sdist, wheel)`` built as a release would be: the wheel from the unpacked sdist."""
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


def test_license_is_the_apache_2_text():
    assert hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256


def test_wheel_holds_the_package_license_and_metadata_only(dists):
    _, wheel = dists
    assert wheel.name == f"sinkattn-{sinkattn.__version__}-py3-none-any.whl"
    info = f"sinkattn-{sinkattn.__version__}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {n for n in names if not n.startswith(info + "/")} == _sources()
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert f"\nVersion: {sinkattn.__version__}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata and "\nLicense-File: LICENSE\n" in metadata
    assert f"\nRequires-Dist: torch>={_pyproject_floor()}\n" in metadata
    assert metadata.rstrip().endswith((ROOT / "README.md").read_text().rstrip())   # the long description
    assert "sinkattn = sinkattn.__main__:main" in entry_points


def test_wheel_holds_no_test_harness(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert {n.split("/")[0] for n in names} == {"sinkattn", f"sinkattn-{sinkattn.__version__}.dist-info"}
    testing = {n.removeprefix("sinkattn/testing/") for n in names if n.startswith("sinkattn/testing/")}
    assert testing == {f"{m}.py" for m in TESTING}
    assert HARNESS and not [n for n in names if "harness" in n or n.startswith("tests/")]
    assert not {f"sinkattn/testing/{m}.py" for m in HARNESS} & set(names)


def test_installed_wheel_imports_and_runs_without_the_tests_dir(dists, tmp_path):
    """The wheel unpacked (all a pure-Python install puts in site-packages) and imported in an isolated
    interpreter (``-I``: no PYTHONPATH, no current folder) with no tests/ on its path: every module imports
    (a missing optional extra aside), the CPU path that reads the instruction-set ceilings runs, the
    golden check of one L0 case passes, the bench header and ``sinkattn --help`` work, and nothing from
    tests/ was imported."""
    _, wheel = dists
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = f"""
import importlib, importlib.util, pkgutil, sys
sys.path.insert(0, {str(site)!r})
import torch
import sinkattn
assert sinkattn.__file__.startswith({str(site)!r}), sinkattn.__file__
assert importlib.util.find_spec("harness") is None and not any("tests" in p.split("/") for p in sys.path), sys.path
for info in pkgutil.walk_packages(sinkattn.__path__, "sinkattn."):
    if info.name == "sinkattn.__main__":
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:        # an optional extra (triton, transformers) not installed
        assert exc.name.split(".")[0] not in ("sinkattn", "harness"), (info.name, exc)
from sinkattn.backends import cpu_native
cpu_native.bf16_products(torch.zeros(1, dtype=torch.bfloat16))     # the AMX check: sinkattn.backends.isa
from sinkattn.testing import bench, cases, verify
result = verify.run_case(cases.cases("L0")[0], "cpu", gate_b=True)
assert result.passed, result.error or [r.as_dict() for r in result.reports]
print(bench.header("cpu")["dispatch"])
from sinkattn.__main__ import main
try:
    main(["--help"])
except SystemExit as exc:
    assert exc.code == 0, exc.code
loaded = [m for m, mod in list(sys.modules.items()) if m.split(".")[0] in ("harness", "tests")
          or "/tests/" in (getattr(mod, "__file__", None) or "")]
assert not loaded, loaded
print("imported without tests/")
"""
    run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env={**os.environ, "SINKATTN_CPU_KERNEL": "python"})   # no kernel build here
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "usage: sinkattn" in run.stdout and run.stdout.rstrip().endswith("imported without tests/")


def _imports(path: Path, module: str) -> set[str]:
    """The modules ``path`` (module ``module``) imports, relative imports resolved, at any depth of its code."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return found


def test_imports_point_down_library_testing_cli():
    """The library never imports ``sinkattn.testing`` (only the command on top of both, ``__main__``, does),
    and ``sinkattn.testing`` imports nothing of the test harness."""
    src = ROOT / "src"
    for path in sorted((src / "sinkattn").rglob("*.py")):
        module = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        imported = _imports(path, module)
        if module.startswith("sinkattn.testing"):
            assert not [m for m in imported if m.split(".")[0] in ("harness", "tests")], (module, imported)
        elif module != "sinkattn.__main__":
            assert not [m for m in imported if m.startswith("sinkattn.testing")], (module, imported)


def test_sdist_holds_the_package_and_its_documents_only(dists):
    sdist, _ = dists
    top = f"sinkattn-{sinkattn.__version__}"
    with tarfile.open(sdist) as t:
        files = {m.name.removeprefix(top + "/") for m in t.getmembers() if m.isfile()}
    expected = {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "PKG-INFO", "setup.cfg", "MANIFEST.in"}
    expected |= {f"src/{s}" for s in _sources()}
    assert {f for f in files if not f.startswith("src/sinkattn.egg-info/")} == expected


def test_changelog_describes_this_version():
    versions = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert versions and versions[0] in ("Unreleased", sinkattn.__version__)
    assert sinkattn.__version__ in versions


def test_torch_floor_is_one_version_in_pyproject_readme_and_ci():
    floor = _pyproject_floor()
    readme = (ROOT / "README.md").read_text()
    assert f"torch >= {floor}" in readme, "the README's table states the floor"
    assert "bash .ci/floor" in (ROOT / ".ci" / "run").read_text()
    job = (ROOT / ".ci" / "floor").read_text()
    assert re.search(rf"^FLOOR_TORCH={re.escape(floor)}\.\d+$", job, flags=re.M), "the floor job installs the floor"
