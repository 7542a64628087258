"""The request path compiled with mypyc: which modules, the build, and the guard against a stale
build. `python -m gateway.build_native [ROOT]` compiles; `make setup` runs it.

Sluice stays Python: mypyc compiles these modules, as typed, into C extensions that sit beside
their sources (`gateway/forward/relay.cpython-311-….so` beside `relay.py`, and the group's shared
library `gateway/_native__mypyc….so`). Python imports an extension before the source of the
same name, so a build that no longer matches its sources would run old code. The build
therefore writes `gateway/_native.json` with a digest of the sources it compiled, and `guard`
(run by `gateway/__init__`, before any of these modules is imported) serves every one of them
from its source instead when the digest differs, when there is no build, or when
`SLUICE_PURE=1` asks for it (a profiler then sees Python frames). All or none: the compiled
modules call each other directly, so a mix would run old code too. `STATE` says which; the
server logs it at start, `sluice bench` prints it, and the strict suite requires "compiled".

Not compiled: the modules mypyc cannot run as written (Generic classes, weak references to
slotted objects, values whose runtime type differs from their stubs'), the gRPC paths and
everything off the request path.

Each compiled module's docstring begins with `(compiled)`. The compiled modules keep the rules
of "The compiled request path" in docs/contributing.md (among them: no `await` inside an
`except` or `finally` block, since mypyc keeps one exception state per thread, not per
coroutine); `tests/test_native_rules.py` checks them and the marker.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

MODULES = (
    "gateway.context",
    "gateway.adapters.common",
    "gateway.adapters.aiohttp.exchange",
    "gateway.auth.tokens",
    "gateway.adapters.native.conn",
    "gateway.adapters.native.exchange",
    "gateway.adapters.native.messages",
    "gateway.adapters.h2.huffman",
    "gateway.adapters.h2.exchange",
    "gateway.adapters.h2.stream",
    "gateway.forward.answers",
    "gateway.forward.body_phase",
    "gateway.forward.deadlines",
    "gateway.forward.exchange",
    "gateway.forward.failures",
    "gateway.forward.first_token",
    "gateway.forward.headers",
    "gateway.forward.inflight",
    "gateway.forward.http",
    "gateway.forward.lifecycle",
    "gateway.forward.relay",
    "gateway.upstream.conn",
    "gateway.upstream.pool",
    "gateway.upstream.request",
    "gateway.upstream.response",
    "gateway.filters.access_log",
    "gateway.filters.admission",
    "gateway.filters.auth",
    "gateway.filters.budget",
    "gateway.filters.base",
    "gateway.filters.chain",
    "gateway.filters.choice",
    "gateway.filters.model_routing",
    "gateway.filters.ratelimit",
    "gateway.filters.ratelimit_steps",
    "gateway.filters.ratelimit_tokens",
    "gateway.filters.ratelimit_wait",
    "gateway.filters.registry",
    "gateway.filters.request_id",
    "gateway.filters.routing",
    "gateway.filters.trace",
    "gateway.telemetry.requests",
    "gateway.telemetry.tally",
    "gateway.telemetry.accesslog",
    "gateway.reload.traffic",
    "gateway.registry.member",
    "gateway.registry.view",
    "gateway.snapshot",
    "gateway.policy.compiled",
    "gateway.ratelimit.compiled",
    "gateway.ratelimit.state",
    "gateway.budgets.compiled",
    "gateway.budgets.entries",
    *(
        f"gateway.core.{m}"
        for m in [
            "affinity",
            "apis",
            "balancer",
            "body",
            "breaker",
            "budgets",
            "canary",
            "clock",
            "concurrency",
            "fairqueue",
            "fairrecords",
            "first_token",
            "health",
            "histogram",
            "jwtclaims",
            "keyrefresh",
            "keys",
            "keystate",
            "lease",
            "limiter",
            "models",
            "outcome",
            "outlier",
            "overload",
            "placement",
            "pressure",
            "protowire",
            "request",
            "retry",
            "rollout",
            "sampler",
            "sse",
            "status",
            "tokens",
            "traceparent",
            "verdict",
            "window",
        ]
    ),
)
GROUP = "gateway._native"  # the shared library: gateway/_native__mypyc.<abi>.so
MANIFEST = "_native.json"  # in the package directory, written by `build`
PACKAGE = Path(__file__).resolve().parent

STATE = "pure: not guarded yet"  # "compiled", or "pure: <why>" (set by `guard`)


def sources(root: Path) -> list[Path]:
    """The source file of each compiled module under `root` (the directory holding gateway/)."""
    return [root.joinpath(*m.split(".")).with_suffix(".py") for m in MODULES]


def digest(root: Path) -> str:
    """What the build compiled: the modules' names and sources, and the Python it is for."""
    h = hashlib.sha256(sys.implementation.cache_tag.encode())
    for name, path in zip(MODULES, sources(root), strict=True):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def built_for(package: Path) -> str | None:
    """The digest the build in `package` was made from (None: no build there)."""
    try:
        doc = json.loads((package / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    value = doc.get("digest") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None


class _FromSource(importlib.abc.MetaPathFinder):
    """Imports every module of the package that has a source file from that source (ahead of
    the path finder, which would take an extension beside it)."""

    def __init__(self, package: Path) -> None:
        self.root = package.parent

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("gateway."):
            return None
        file = self.root.joinpath(*fullname.split(".")).with_suffix(".py")
        if not file.is_file():
            return None  # a package (its __init__ is never compiled) or no such module
        return importlib.util.spec_from_file_location(fullname, file)


def _extensions(package: Path) -> set[str]:
    """The modules that have an extension file in `package` (the group's library included)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    root = package.parent
    return {
        ".".join(p.relative_to(root).parts)[: -len(suffix)] for p in package.rglob(f"*{suffix}")
    }


def _group_lib(package: Path) -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return package / f"{GROUP.rsplit('.', 1)[1]}__mypyc{suffix}"


def guard(package: Path = PACKAGE) -> str:
    """Decide once per process, before the modules are imported: compiled, or all from source."""
    global STATE
    if any(isinstance(f, _FromSource) for f in sys.meta_path) or STATE == "compiled":
        return STATE
    if os.environ.get("SLUICE_PURE") == "1":
        why = "SLUICE_PURE=1"
    elif not _group_lib(package).exists():
        why = "no compiled build (make setup builds it)"
    elif built_for(package) != digest(package.parent) or _extensions(package) != {
        *MODULES,
        GROUP + "__mypyc",
    }:
        why = "the compiled build is older than its sources (make setup rebuilds it)"
    else:
        STATE = "compiled"
        return STATE
    STATE = f"pure: {why}"
    sys.meta_path.insert(0, _FromSource(package))
    return STATE


def build(root: Path, jobs: int = 2) -> int:
    """Compile MODULES under `root` in place (mypyc, then the C compiler), then write the
    manifest. Nothing is done when the manifest already matches the sources."""
    package = root / "gateway"
    want = digest(root)
    if built_for(package) == want and _extensions(package) == {*MODULES, GROUP + "__mypyc"}:
        print("gateway.native: the compiled build matches its sources")
        return 0
    from mypyc.build import mypycify  # mypy's compiler: a build-time dependency only
    from setuptools import Distribution  # type: ignore[import-untyped]
    from setuptools.command.build_ext import build_ext  # type: ignore[import-untyped]

    (package / MANIFEST).unlink(missing_ok=True)  # a half-done build is never taken as current
    # Unlinked, not overwritten: a running gateway keeps the files it has mapped.
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for old in package.rglob(f"*{suffix}"):  # modules no longer compiled go too
        old.unlink()
    cwd = Path.cwd()
    os.chdir(root)  # mypyc names modules by their paths relative to here
    try:
        files = [str(p.relative_to(root)) for p in sources(root)]
        exts = mypycify(files, opt_level="3", group_name=GROUP, target_dir="build/native")
        dist = Distribution({"name": "sluice-native", "ext_modules": exts})
        cmd = build_ext(dist)
        cmd.inplace = True
        cmd.parallel = jobs
        cmd.build_temp = "build/native/temp"
        cmd.build_lib = "build/native/lib"
        cmd.ensure_finalized()
        cmd.run()
    finally:
        os.chdir(cwd)
    (package / MANIFEST).write_text(json.dumps({"digest": want, "modules": list(MODULES)}) + "\n")
    print(f"gateway.native: compiled {len(MODULES)} modules")
    return 0
