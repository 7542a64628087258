from __future__ import annotations

import sys

from gateway.cli import main

sys.exit(main())
