"""Process settings from the environment (SLUICE_*), read once at boot. Policy lives elsewhere."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gateway.resources import policies_dir

# The checkout's policies/default.yaml, or the copy an installed package carries.
DEFAULT_POLICY = policies_dir() / "default.yaml"


@dataclass(frozen=True, slots=True)
class Settings:
    policy_path: Path = DEFAULT_POLICY
    log_level: str = "INFO"
    workers: int = 1
    watch_interval_s: float = 1.0  # how often the policy file is looked at for changes
    tls_watch_interval_s: float = 2.0  # how often listeners' certificate files are looked at
    status_sample_s: float = 5.0  # the status page's history and charts: one point this often

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        return cls(
            policy_path=Path(e.get("SLUICE_POLICY", str(DEFAULT_POLICY))),
            log_level=e.get("SLUICE_LOG_LEVEL", "INFO").upper(),
            workers=int(e.get("SLUICE_WORKERS", "1")),
            watch_interval_s=float(e.get("SLUICE_WATCH_INTERVAL", "1.0")),
            tls_watch_interval_s=float(e.get("SLUICE_TLS_WATCH_INTERVAL", "2.0")),
            status_sample_s=max(0.1, float(e.get("SLUICE_STATUS_SAMPLE_S", "5.0"))),
        )
