"""Kiln gateway: the shared layer every function uses.

Modules, one concern each: settings, errors, jsonio, catalog, normalize, metering,
auth, maintenance, parameters, upstream, sse, exchange, handlers, responses, web,
gateway (the long-lived services) and store (DynamoDB). Import what you need; nothing
heavy is imported here, since a Lambda cold start pays for every module.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
