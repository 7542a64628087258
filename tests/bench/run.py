"""`python -m tests.bench.run [options]`: the same as `sluice bench [options]`.

The work is done by the gateway.bench package; this wrapper only builds the parser and runs it.
"""

from __future__ import annotations

import argparse
import sys

from gateway import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.run", description=bench.__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    bench.configure(parser)
    return bench.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
