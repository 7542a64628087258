"""Generated protobuf code for the simulated backend's inference service.

`make` generates `inference_pb2*.py` next to the .proto at build time (they are not committed);
`load()` generates them on first use if a build step was skipped (an editable checkout).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent


def generate(out_dir: Path = _HERE) -> None:
    """Run protoc (from grpcio-tools) on inference.proto."""
    from grpc_tools import protoc  # build-time dependency, imported only here

    proto_include = Path(protoc.__file__).resolve().parent / "_proto"
    # Generated files import "gateway.proto.inference_pb2" because the include root is the repo.
    root = _HERE.parent.parent
    rc = protoc.main(
        [
            "protoc",
            f"-I{root}",
            f"-I{proto_include}",
            f"--python_out={root}",
            f"--grpc_python_out={root}",
            str(_HERE.relative_to(root) / "inference.proto"),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")


def load() -> tuple[ModuleType, ModuleType]:
    """Return (inference_pb2, inference_pb2_grpc), generating them if they are missing."""
    if not (_HERE / "inference_pb2.py").exists() or not (_HERE / "inference_pb2_grpc.py").exists():
        generate()
        importlib.invalidate_caches()
    pb2 = importlib.import_module("gateway.proto.inference_pb2")
    pb2_grpc = importlib.import_module("gateway.proto.inference_pb2_grpc")
    return pb2, pb2_grpc


if __name__ == "__main__":
    generate()
