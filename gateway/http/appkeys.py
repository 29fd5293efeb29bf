"""Typed application keys shared by the app factory and the route modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.config.model import Config
    from gateway.store.protocol import Store
    from gateway.telemetry.metrics import Metrics

CONFIG: web.AppKey[Config] = web.AppKey("config")
STORE: web.AppKey[Store] = web.AppKey("store")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
