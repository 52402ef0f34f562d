"""Local training alone: dense models, no neighbours, nothing sent; the baseline every
strategy must beat, and the model a device's fallback trains beside any other
(`agent.learning.fallback`)."""

from __future__ import annotations

from agent.learning.decentral.base import DecentralizedStrategy


class Local(DecentralizedStrategy):
    """local: the dense round with an empty inbox (the table says it `alone`)."""

    name = "local"
