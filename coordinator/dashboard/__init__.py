"""The fleet dashboard: a live web page, its JSON and event stream, and Prometheus metrics.

Feed a `FleetState` from the fleet's presence and status topics and serve it with
`Dashboard`; see `app.py` for the routes and `metrics.py` for the series.
"""

from coordinator.dashboard.app import Dashboard, create_app
from coordinator.dashboard.state import FleetState

__all__ = ["Dashboard", "FleetState", "create_app"]
