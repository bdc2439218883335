"""Lay out an empty package skeleton from pyproject.toml, for the image's dependency layer.

The Dockerfile copies only ``pyproject.toml`` and this script, runs it, and ``pip install``s the
result: that installs every dependency the project declares in a layer that is rebuilt only when
pyproject.toml changes, not on every source edit. The packages are read from
``[tool.setuptools]`` (a ``packages`` list, or the roots ``packages.find`` includes) so the skeleton
follows the project without edits here.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any


def package_dirs(pyproject: dict[str, Any]) -> list[Path]:
    """Where setuptools looks for each listed package, honouring ``package-dir``."""
    tool = pyproject.get("tool", {}).get("setuptools", {})
    mapping: dict[str, str] = tool.get("package-dir", {})
    listed = tool.get("packages", [])
    if isinstance(listed, dict):  # packages.find: the included roots are enough to install
        patterns = listed.get("find", {}).get("include", [])
        listed = sorted({p.split(".")[0].rstrip("*") for p in patterns} - {""})
    out: list[Path] = []
    for package in listed:
        parts = package.split(".")
        # The longest mapped prefix wins; "" maps the root.
        for cut in range(len(parts), -1, -1):
            key = ".".join(parts[:cut])
            if key in mapping:
                out.append(Path(mapping[key], *parts[cut:]))
                break
        else:
            out.append(Path(*parts))
    return out


def make_skeleton(root: Path) -> list[Path]:
    """Create ``__init__.py`` for every package and the files the metadata names; returns the dirs."""
    with open(root / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    dirs = package_dirs(pyproject)
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "__init__.py").touch()
    readme = pyproject.get("project", {}).get("readme")
    if isinstance(readme, str) and not (root / readme).exists():
        (root / readme).write_text("placeholder\n")
    return dirs


if __name__ == "__main__":
    made = make_skeleton(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
    print("skeleton:", " ".join(str(d) for d in made))
