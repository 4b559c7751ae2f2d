"""The README and every docs/*.md page: each ```python block runs on its own, in a fresh process, as a reader
would paste it (commands that need torchrun or a GPU are ```bash blocks, shown, not run), and every relative
link reaches an existing file and heading. A block that imports an integration (transformers, trl, peft,
deepspeed) is skipped where that is not installed (the test-core extra)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cold_cache_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def _snippets() -> dict[str, str]:
    """``{page-blockN: code}`` over every page; a block repeated on a later page (the README's quick start of a
    page's example) runs once, under its first name."""
    seen, out = set(), {}
    for page in PAGES:
        for i, code in enumerate(_blocks(page)):
            if code not in seen:
                seen.add(code)
                out[f"{page.stem}-block{i}"] = code
    return out


SNIPPETS = _snippets()

INTEGRATIONS = {"transformers": "transformers", "sinkattn.hf": "transformers", "trl": "trl", "peft": "peft",
                "deepspeed": "deepspeed"}
"""What a block's imports need beyond the test-core extra: ``import``/``from`` name -> the package it needs."""


def _missing_integrations(code: str) -> list[str]:
    """The packages of ``INTEGRATIONS`` that ``code`` imports and this environment lacks."""
    needed = set()
    for name in re.findall(r"^\s*(?:import|from)\s+([\w.]+)", code, flags=re.M):
        for prefix, package in INTEGRATIONS.items():
            if name == prefix or name.startswith(prefix + "."):
                needed.add(package)
    return sorted(p for p in needed if importlib.util.find_spec(p) is None)


@pytest.mark.parametrize("code", SNIPPETS.values(), ids=SNIPPETS.keys())
def test_block_runs_on_its_own(code, tmp_path):
    missing = _missing_integrations(code)
    if missing:
        pytest.skip(f"the block imports {', '.join(missing)}, not installed (the test extra installs it)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=cold_cache_env(tmp_path))
    assert run.returncode == 0, f"block failed:\n{code}\n--- stderr ---\n{run.stderr[-3000:]}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_reach_a_file_and_heading(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and anchor not in _anchors(file)):
            broken.append(target)
    assert broken == [], f"{page.name}: links to missing files or headings: {broken}"
