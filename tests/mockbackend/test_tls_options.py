"""`sluice mock-backend --tls-cert/--tls-key/--tls-client-ca`: listed in --help, and a key
without its certificate is refused before anything listens (the TLS listeners themselves are
exercised in tests/tls/test_upstream.py and tests/integration/test_upstream_tls.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "mock-backend", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_documents_the_tls_options() -> None:
    out = sluice("--help").stdout
    for option in ("--tls-cert PEM", "--tls-key PEM", "--tls-client-ca PEM"):
        assert option in out, out
    assert "mutual" in out and "TLS" in out


def test_a_key_without_its_certificate_is_refused() -> None:
    result = sluice("--tls-key", "/nonexistent.key", "--no-admin", "--http", "127.0.0.1:0")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--tls-cert and --tls-key go together" in result.stdout + result.stderr
