"""Regenerate the committed gRPC stubs from seekserve.proto.

    python -m serve_app.protos.generate [--out DIR]

tests/test_grpc_stubs.py regenerates into a temporary folder and fails when
the committed stubs differ, so the proto and the stubs cannot drift apart.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "serve_app/protos/seekserve.proto"
GENERATED = ("seekserve_pb2.py", "seekserve_pb2.pyi", "seekserve_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        # -I at the repo root so the stubs import each other as serve_app.protos.*
        rc = protoc.main(
            ["protoc", f"-I{ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(ROOT / PROTO)]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(Path(tmp) / "serve_app" / "protos" / name, out_dir / name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "serve_app" / "protos"))
    generate(Path(p.parse_args().out))


if __name__ == "__main__":
    main()
