from __future__ import annotations

import sys
from pathlib import Path

# bcc ships as Debian's python3-bpfcc in the system dist-packages; add it, do not vendor it.
_BCC = Path("/usr/lib/python3/dist-packages")
if (_BCC / "bcc").is_dir() and str(_BCC) not in sys.path:
    sys.path.append(str(_BCC))
