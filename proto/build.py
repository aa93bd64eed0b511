"""Generate the Python protobuf / gRPC modules from proto/**/*.proto (the build's job; never edit them).

    python -m proto.build            # regenerate when a .proto is newer than its output
    python -m proto.build --force

Output lands beside the sources (proto/duet/v1/*_pb2.py, *_pb2_grpc.py, *.pyi) and is git-ignored.
Imports are rooted at the repository (`from proto.duet.v1 import generate_pb2`), so protoc runs with
the repo root as its include path. `ensure_generated()` lets a module that needs the generated code
build it on first import when someone runs Python without `make install`.
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "proto").rglob("*.proto"))
_LOCK = threading.Lock()


def _outputs(src: Path) -> list[Path]:
    stem = src.with_suffix("")
    return [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2_grpc.py")]


def is_stale() -> bool:
    for src in SOURCES:
        for out in _outputs(src):
            if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
                return True
    return False


def generate(force: bool = False) -> list[Path]:
    with _LOCK:
        if not force and not is_stale():
            return []
        from grpc_tools import protoc  # build-time dependency (grpcio-tools, pinned with grpcio)

        rel = [str(s.relative_to(ROOT)) for s in SOURCES]
        include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto
        args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
                f"--grpc_python_out={ROOT}", *rel]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {rel}")
        return SOURCES


def ensure_generated() -> None:
    if is_stale():
        generate()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    done = generate(force=args.force)
    print(f"proto: generated {len(done)} file(s)" if done else "proto: up to date", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
