"""Where the files that ship with Sluice are found: the default policy, its schema and examples,
the eBPF sources.

In a checkout they sit at the repository's top level (`policies/`, `ebpf/`). An installed
package carries them inside itself as `gateway/_policies` and `gateway/_ebpf` (setup.py maps the
repository folders there), so `sluice serve` finds its default policy from any directory.
The status page's files live in the `gateway.status` package in both cases.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _first(installed: Path, checkout: Path) -> Path:
    return installed if installed.is_dir() else checkout


def policies_dir() -> Path:
    """`policies/`: default.yaml, schema.json, examples/."""
    return _first(_PACKAGE / "_policies", _PACKAGE.parent / "policies")


def ebpf_dir() -> Path:
    """`ebpf/`: the TC classifier's C source and its map header (the ABI)."""
    return _first(_PACKAGE / "_ebpf", _PACKAGE.parent / "ebpf")
