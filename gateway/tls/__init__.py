"""Every SSL context Sluice builds, in one package; no module outside it builds one
(`tests/test_layout.py` holds it).

- `listener`: the listeners' TLS: one owner per listener (`TlsOwner`) serving its context,
  rotating it when its files change, and the gRPC listener's credentials;
- `material`: the listener's certificate, key and client CA read and checked, the server
  context built from them, and the client identity of a verified certificate (mTLS);
- `upstream`: the client contexts and gRPC channel credentials toward backends;
- `files`: the bounded read of a PEM file;
- `local`: the contexts of Sluice's own tools (the simulated backend's listeners, the
  readiness probe of `sluice bench`).
"""

from __future__ import annotations
