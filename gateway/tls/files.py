"""Reading TLS files (certificates, keys, CA bundles) for the listeners and for the backends.

One bounded read: a file that cannot be read, or is larger than `MAX_FILE_BYTES`, is a
`TlsError` naming the policy field at fault. File contents are never put in a message: only
paths and the OS's reason.
"""

from __future__ import annotations

from gateway.errors import TlsError

MAX_FILE_BYTES = 1024 * 1024  # a PEM chain or bundle is a few KiB; anything larger is a mistake


def read_pem(field: str, path: str) -> bytes:
    """The bytes of the file at `path` (policy field `field`); raises TlsError (`unreadable`,
    or `invalid` when larger than MAX_FILE_BYTES)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise TlsError(field, "unreadable", f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise TlsError(field, "invalid", f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return data
