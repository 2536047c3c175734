"""Moved to :mod:`mlx_fleet.http_hygiene` (shared with the fleet router). Kept only until
``node_agent/openai_api.py`` (being split by issue 16) imports it from there."""

from mlx_fleet.http_hygiene import HttpLimits, hygiene_middlewares

__all__ = ["HttpLimits", "hygiene_middlewares"]
