"""The install profiles (extras) and a one-line error when a command needs one that is absent.

The base package is a device's install; the gateway and the lab are extras so that a device
does not carry their hundreds of megabytes. A command checks the modules it will use before it
starts anything, so a missing extra is said once, with what to install, and never surfaces as
a traceback half-way through starting a broker or a fleet.
"""

from __future__ import annotations

import importlib.util

from protocol.cli import ConfigError
from protocol.version import DISTRIBUTION

GATEWAY_EXTRA = "gateway"
"""`coordinator serve` and `run`: embedded broker, dashboard, /metrics, plots."""
LAB_EXTRA = "lab"
"""`coordinator simulate` and `emulate`: built-in datasets, plots, embedded broker."""
PRIVACY_EXTRA = "privacy"
"""`--dp sample`: the privacy accountant (dp-accounting), on every device of such a run."""

DISTRIBUTIONS = {
    "amqtt": "amqtt",
    "dp_accounting": "dp-accounting",
    "matplotlib": "matplotlib",
    "mnist1d": "mnist1d",
    "prometheus_client": "prometheus-client",
    "sklearn": "scikit-learn",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
}
"""The distribution behind each module an extra brings (named in the error)."""

EMBEDDED_BROKER = ("amqtt",)
DASHBOARD = ("starlette", "uvicorn", "prometheus_client")
PLOTS = ("matplotlib",)
ACCOUNTANT = ("dp_accounting",)
DATASETS = {"digits": ("sklearn",), "mnist1d": ("mnist1d",)}
"""The modules of each feature an extra provides; a built-in dataset by its name."""


class MissingExtra(ConfigError):
    """A feature whose extra is not installed: one line that says what to install, exit 2."""


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(extra: str, modules: tuple[str, ...], feature: str) -> None:
    """Raise MissingExtra unless every module of `feature` can be imported."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        names = ", ".join(DISTRIBUTIONS.get(m, m) for m in missing)
        raise MissingExtra(
            f"{feature} needs the {extra} extra ({names} not installed): {install_hint(extra)}"
        )
