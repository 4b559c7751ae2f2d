"""Every ```python block of the README runs on its own, in a fresh process, as a reader would paste it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cold_cache_env

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs_on_its_own(code, tmp_path):
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=cold_cache_env(tmp_path))
    assert run.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{run.stderr[-3000:]}"
