"""ruff and mypy check the same modules, under the names an install gives them.

In the checkout the code sits in top-level folders that ``prefixgate/`` links to. ruff reads the
folders (it does not follow directory links) and mypy reads the links (the imports name
``prefixgate.*``, so mypy must see each file under that name, once). Each tool's exclusions are the
other's, written separately in ``pyproject.toml``; this keeps them from drifting apart, so no module
goes unlinted or untyped.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from mypy import fscache
from mypy.config_parser import parse_config_file
from mypy.find_sources import create_source_list
from mypy.options import Options

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_and_mypy_see_the_same_files() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--show-files", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    ruffed = {Path(p).resolve() for p in listed if p.endswith(".py")}
    options = Options()
    parse_config_file(options, lambda: None, str(ROOT / "pyproject.toml"), io.StringIO(), io.StringIO())
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)  # mypy's exclusions are relative to where it runs, as in CI
        sources = create_source_list(["."], options, fscache.FileSystemCache())
    finally:
        os.chdir(cwd)
    # A file seen through a link counts as the file it links to.
    typed = {(ROOT / s.path).resolve() for s in sources if s.path}
    assert sorted(str(p.relative_to(ROOT)) for p in ruffed - typed) == [], "linted but not type-checked"
    assert sorted(str(p.relative_to(ROOT)) for p in typed - ruffed) == [], "type-checked but not linted"
