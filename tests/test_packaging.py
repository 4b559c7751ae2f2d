"""What ``python -m build`` makes of the repository: the sdist and the wheel carry the package, its licence
and metadata, and nothing else; the torch floor is one version in pyproject, the README and .ci/floor."""

import hashlib
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
