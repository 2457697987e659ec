"""Generate the Python protobuf/gRPC code from ``protos/`` into ``shared/genproto``.

``--check`` regenerates into a temporary folder and fails if the checked-in
code differs (CI runs it, so stale generated code cannot land).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "shared" / "genproto"
PACKAGE = "shared.genproto"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency, only needed here

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    if protoc.main(args + [str(p) for p in protos]) != 0:
        raise SystemExit("protoc failed")
    # protoc writes absolute imports ("from cleave.v1 import worker_pb2"); make them package-relative to this tree.
    for path in out_dir.rglob("*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^from cleave\.", f"from {PACKAGE}.cleave.", text, flags=re.M)
        fixed = re.sub(r"^import cleave\.", f"import {PACKAGE}.cleave.", fixed, flags=re.M)
        path.write_text(fixed)
    for folder in [out_dir, *[p for p in out_dir.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if shared/genproto is stale")
    args = parser.parse_args(argv)
    if not args.check:
        if OUT_DIR.exists():
            shutil.rmtree(OUT_DIR)
        files = generate(OUT_DIR)
        print(f"generated {len(files)} files in {OUT_DIR.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        current = (
            sorted(p.relative_to(OUT_DIR) for p in OUT_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
            if OUT_DIR.exists()
            else []
        )
        stale = [
            str(p) for p in fresh if p not in current or not filecmp.cmp(Path(tmp) / p, OUT_DIR / p, shallow=False)
        ]
        stale += [str(p) for p in current if p not in fresh]
    if stale:
        print(f"shared/genproto is stale ({', '.join(stale)}); run `make protos` and commit", file=sys.stderr)
        return 1
    print("shared/genproto is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
