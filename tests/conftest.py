from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# bcc ships as Debian's python3-bpfcc in the system dist-packages; add it, do not vendor it.
_BCC = Path("/usr/lib/python3/dist-packages")
if (_BCC / "bcc").is_dir() and str(_BCC) not in sys.path:
    sys.path.append(str(_BCC))


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    """A `tests.support.Proc` a test started and did not stop (it failed first) is stopped here,
    not left running into the tests after it. Those of wider fixtures started before the test."""
    from tests.support import Proc

    before = list(Proc.live)
    yield
    for proc in [p for p in Proc.live if p not in before]:
        proc.stop()
