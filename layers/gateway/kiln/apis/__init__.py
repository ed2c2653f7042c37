"""The rules of each model endpoint: what its body must hold, how its usage is read and billed,
and how its stream is relayed. One module per endpoint; `kiln.endpoints` lists them."""

from .base import ModelApi

__all__ = ["ModelApi"]
