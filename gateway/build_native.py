"""`python -m gateway.build_native [ROOT]`: compile the request path (`gateway.native`) under
ROOT (default: this checkout); `--state` prints what this process runs (compiled or why not).
"""

from __future__ import annotations

import sys
from pathlib import Path

from gateway import native


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--state"]:
        print(native.STATE)
        return 0
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m gateway.build_native [ROOT] | --state", file=sys.stderr)
        return 2
    return native.build(Path(args[0]).resolve() if args else native.PACKAGE.parent)


if __name__ == "__main__":
    raise SystemExit(main())
