"""What pyproject.toml cannot say about the package; the metadata itself lives there.

- The repository's `policies/` and `ebpf/` stay where they are and ship inside the package as
  `gateway/_policies` and `gateway/_ebpf` (see gateway/resources.py), so an installed Sluice
  finds its default policy, schema, examples and eBPF sources from any directory.
- The protobuf modules of the simulated backend are generated into the build (they are not
  committed), so an installed package never writes into its own directory at run time.
- A checkout with the compiled request path built (`make native`: extension modules beside
  their sources) makes a wheel tagged for its interpreter and platform
  (`cp311-cp311-linux_x86_64`); without them the wheel is pure (`py3-none-any`).
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

DATA_PACKAGES = {
    "gateway._policies": "policies",
    "gateway._policies.examples": "policies/examples",
    "gateway._ebpf": "ebpf",
}


class CompiledWhenBuilt(Distribution):
    """A distribution with extension modules when the compiled request path is built here: the
    wheel then carries them and is tagged for this interpreter and platform, not as pure."""

    def has_ext_modules(self) -> bool:
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        return any(Path(__file__).resolve().parent.joinpath("gateway").rglob(f"*{suffix}"))


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        out = Path(self.build_lib)
        if (out / "gateway" / "proto" / "inference_pb2.py").exists():
            return  # copied from a checkout where `make` already generated them
        from grpc_tools import protoc  # a build requirement (pyproject.toml)

        include = Path(protoc.__file__).resolve().parent / "_proto"
        rc = protoc.main(
            [
                "protoc",
                "-I.",
                f"-I{include}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                "gateway/proto/inference.proto",
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")


setup(
    packages=[*find_packages(include=["gateway", "gateway.*"]), *DATA_PACKAGES],
    package_dir=DATA_PACKAGES,
    cmdclass={"build_py": BuildPyWithProtos},
    distclass=CompiledWhenBuilt,
)
