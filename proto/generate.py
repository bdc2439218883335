"""Regenerate the Python code for the .proto contracts.

Run ``python proto/generate.py`` after editing a ``.proto`` file; ``tests/test_proto_fresh.py``
fails while the committed code is stale.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("prefixgate/v1/*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *sources,
    ]
    # protoc finds the mypy plugins on PATH; they live beside this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
