"""One TLS context for the process: loading the CA bundle costs ~25 ms, once is enough."""

from __future__ import annotations

import ssl
from functools import lru_cache

__all__ = ["client_context"]


@lru_cache(maxsize=1)
def client_context() -> ssl.SSLContext:
    import certifi

    return ssl.create_default_context(cafile=certifi.where())
