"""The documentation site (docs/, mkdocs.yml): it builds in strict mode (every page in the
nav, every link and anchor resolves), its settings page is the one ServerArgs generates, every
command it shows is one the code accepts, and no page or comment narrates how a number moved."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.doc_commands import ROOT, check_commands

from radixserve.cli import _build_parser
from radixserve.cli.settings_page import render
from radixserve.config import ServerArgs

DOCS = Path(ROOT) / "docs"
PAGES = sorted(DOCS.glob("*.md"))

# "202 -> 11 ms", "7.3 → 6.1 s", "1.5x -> 2x": a before/after pair of a measurement.
_NUMBER = r"\d+(?:[.,]\d+)*"
_UNIT = r"(?:ms|s|µs|us|%|x|×|GB|MB)"
TIMING_ARROW = re.compile(rf"{_NUMBER}\s*{_UNIT}?\s*(?:->|→)\s*{_NUMBER}\s*{_UNIT}(?![\w^])")


def test_docs_build_in_strict_mode(tmp_path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    site = tmp_path / "site"
    for page in PAGES:
        name = "" if page.stem == "index" else page.stem + "/"
        assert (site / name / "index.html").is_file(), f"{page.name} was not built"
    settings = (site / "settings" / "index.html").read_text()
    assert 'id="page-size"' in settings and "RADIXSERVE_PAGE_SIZE" in settings


def test_settings_page_is_generated_from_server_args() -> None:
    on_disk = (DOCS / "settings.md").read_text()
    assert on_disk == render(), ("docs/settings.md differs from ServerArgs: run "
                                 "python -m radixserve.cli.settings_page docs/settings.md")


def test_every_serve_flag_is_on_the_settings_page() -> None:
    page = (DOCS / "settings.md").read_text()
    serve = _build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [s for a in serve._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    assert len(flags) == len(dataclasses.fields(ServerArgs))
    for flag in flags:
        assert f"### `{flag}` {{ #{flag[2:]} }}" in page, flag
        assert f"`RADIXSERVE_{flag[2:].replace('-', '_').upper()}`" in page, flag
    for f in dataclasses.fields(ServerArgs):  # each help text, as --help shows it
        assert f.metadata["help"].replace("|", "\\|").replace("<", "&lt;") in page, f.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_docs_command_parses(page: Path) -> None:
    check_commands(page.read_text(), f"docs/{page.name}")


def test_a_refused_command_fails_the_check() -> None:
    with pytest.raises(AssertionError, match="--page-sise"):
        check_commands("```bash\nradixserve serve --page-sise 16\n```", "x")
    with pytest.raises(AssertionError, match="--outt"):
        check_commands("`python bench/offline.py --outt x.json`", "x")


def test_no_timing_narratives_in_code_readme_or_docs() -> None:
    """Comments and pages say what is and why; how a number moved is the commits' business."""
    files = [Path(ROOT) / "README.md", *PAGES]
    for folder in ("radixserve", "kernels"):
        files += [p for p in (Path(ROOT) / folder).rglob("*") if p.suffix in (".py", ".cpp", ".h", ".md")]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
             if TIMING_ARROW.search(line)]
    assert not found, "before/after timings:\n" + "\n".join(found[:20])


FILE_PATH = re.compile(r"\b((?:tests|bench|radixserve|examples|kernels)/[\w/.-]*[a-z0-9_]\.(?:py|sh|md|cpp|h))\b")


def test_every_file_the_docs_and_code_name_exists() -> None:
    """A path like ``tests/engine/test_models.py`` in the README, the docs, the package, the
    benchmarks, the tests or CI names a file of this checkout (moved files leave no stale name)."""
    root = Path(ROOT)
    files = [root / "README.md", root / ".ci" / "run", root / "pyproject.toml", *PAGES]
    for folder in ("radixserve", "bench", "tests", "examples"):
        files += [p for p in (root / folder).rglob("*") if p.suffix in (".py", ".sh", ".md")]
    missing = sorted({f"{p.relative_to(root)}: {m}" for p in files for m in FILE_PATH.findall(p.read_text())
                      if "*" not in m and not (root / m).exists()})
    assert not missing, "\n".join(missing)
