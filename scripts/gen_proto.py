"""Regenerate the protobuf/gRPC Python modules from proto/ into shared/v1/.

`python scripts/gen_proto.py` writes them; `--check DIR` writes into DIR instead (the
staleness test compares that output with the committed files).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
TARGET = ROOT / "shared" / "v1"


def generate(target: Path) -> list[Path]:
    from grpc_tools import protoc  # test/dev dependency only

    sources = sorted(
        str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("tokenyard/v1/*.proto")
    )
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *sources,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        # protoc writes tmp/tokenyard/v1/*.py with `from tokenyard.v1 import ...` imports, which is
        # exactly where shared/v1 is importable from.
        target.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted((Path(tmp) / "tokenyard" / "v1").iterdir()):
            shutil.copy(f, target / f.name)
            written.append(target / f.name)
    init = target / "__init__.py"
    if not init.exists():
        init.write_text(
            '"""Generated protobuf and gRPC modules (scripts/gen_proto.py). Do not edit."""\n'
        )
    return written


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", type=Path, help="write into this folder instead of shared/v1")
    args = parser.parse_args()
    for path in generate(args.check or TARGET):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
