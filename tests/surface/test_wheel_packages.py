"""The wheel holds exactly the source folders: every package and every module, nothing stale.

The package list is found through the ``prefixgate/`` links, so this is what keeps a new folder
without an ``__init__.py`` (left out of the wheel) or a module outside any package from passing
in the checkout, where the folders import fine, and failing only once installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The installed name of each source folder (the links in prefixgate/ say the same).
FOLDERS = {
    "prefixgate": ROOT / "prefixgate",
    "prefixgate.gateway": ROOT / "gateway",
    "prefixgate.cachetier": ROOT / "cachetier",
    "prefixgate.backends": ROOT / "backends",
    "prefixgate.bench": ROOT / "bench",
    "prefixgate.v1": ROOT / "proto" / "prefixgate" / "v1",
}
COPIED = ("pyproject.toml", "README.md", "prefixgate", "gateway", "cachetier", "backends", "bench", "proto")


def _source_modules() -> set[str]:
    """``prefixgate/…/x.py`` for every module in the source folders, as the wheel must name it."""
    found: set[str] = set()
    for name, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder)
            if "__pycache__" in rel.parts or (
                name == "prefixgate" and rel.parts[0] in {"gateway", "cachetier", "backends", "bench", "v1"}
            ):
                continue
            found.add("/".join([*name.split("."), *rel.parts]))
    return found


def test_wheel_has_every_source_module_and_nothing_else(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for item in COPIED:
        if (ROOT / item).is_dir():
            shutil.copytree(
                ROOT / item,
                src / item,
                symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
            )
        else:
            shutil.copy2(ROOT / item, src / item)
    # No build isolation: the build uses this environment's setuptools, so no network is needed.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        timeout=120,
    )
    (wheel,) = (tmp_path / "dist").glob("prefixgate-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {n for n in zf.namelist() if n.endswith(".py")}
    expected = _source_modules()
    assert sorted(expected - in_wheel) == [], "source modules the wheel leaves out"
    assert sorted(in_wheel - expected) == [], "modules in the wheel with no source file"
    packages = {n.rsplit("/", 1)[0] for n in in_wheel if n.endswith("/__init__.py")}
    assert {n.rsplit("/", 1)[0] for n in in_wheel} <= packages, "a wheel folder without __init__.py"
