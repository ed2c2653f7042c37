"""The model servers' bearer token, kept in a secret store rather than the function's configuration.

A backend whose catalog entry says `"api_key_env": "KILN_UPSTREAM_API_KEY"` is sent this
key. In AWS it is an SSM SecureString (`KILN_UPSTREAM_API_KEY_PARAMETER` names it), read
with decryption through the gateway's parameter cache: anyone allowed
`lambda:GetFunctionConfiguration` sees a function's environment, never this key, and a
rotation (one `put-parameter`) reaches every environment within the cache time, without a
deploy. Without a parameter (the local stack) the environment variable is read, as for
any other `api_key_env`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .catalog import Backend, Catalog
from .parameters import CachedParameter

__all__ = ["ENV_NAME", "UpstreamKey", "parse_key"]

ENV_NAME = "KILN_UPSTREAM_API_KEY"


@dataclass(frozen=True)
class _KeyedBackend(Backend):
    """A backend with its key in hand (never printed, never compared)."""

    key: str | None = field(default=None, repr=False, compare=False)

    def api_key(self) -> str | None:
        return self.key


class UpstreamKey:
    """Gives the catalog's backends the current key; the keyed catalog is made again only
    when the catalog or the key changed."""

    def __init__(self, cache: CachedParameter[str]) -> None:
        self._cache = cache
        self._bound: tuple[Catalog, str, Catalog] | None = None
        self._unkeyed: Catalog | None = None  # the last catalog bound, if none of its backends names the key

    @property
    def name(self) -> str:
        return self._cache.name

    @property
    def fresh(self) -> bool:
        return self._unkeyed is not None or self._cache.fresh

    async def bind(self, catalog: Catalog) -> Catalog:
        """The catalog with the key given to the backends that name it; a catalog none of whose
        backends does is served as it is, the key not read (a deployment that keeps no key:
        deploy.md stores one only for backends that name it)."""
        if catalog is self._unkeyed:
            return catalog
        if not any(backend.api_key_env == ENV_NAME for model in catalog for backend in model.backends):
            self._unkeyed = catalog
            return catalog
        self._unkeyed = None
        key = await self._cache.get()
        bound = self._bound
        if bound is not None and bound[0] is catalog and bound[1] == key:
            return bound[2]
        keyed = Catalog(
            replace(model, backends=tuple(_with_key(backend, key) for backend in model.backends)) for model in catalog
        )
        self._bound = (catalog, key, keyed)
        return keyed


def _with_key(backend: Backend, key: str) -> Backend:
    if backend.api_key_env != ENV_NAME:
        return backend
    values = {f.name: getattr(backend, f.name) for f in fields(Backend) if f.init}
    return _KeyedBackend(**values, key=key)


def parse_key(raw: str | None) -> str:
    """The parameter's value; a missing or empty one is an error (the cache keeps the last key)."""
    if raw is None or not raw.strip():
        raise ValueError("the upstream key parameter does not exist or is empty")
    return raw.strip()
