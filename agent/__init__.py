"""The device side of edgefl: `learning` (the learning core the simulator, the agent and the
aggregator share), `device` (budget and throttle), `runtime` (the networked agent), `report`
(the round record and run summary), `experiment` and `data` (the experiment mode's datasets
and workload), `files` (atomic writes), `onnx_export` (the personalized model for inference)
and `cli` (`edge-agent`). Each subpackage states its own public API in its `__all__`.
"""

__all__ = [
    "cli",
    "data",
    "device",
    "experiment",
    "files",
    "learning",
    "onnx_export",
    "options",
    "report",
    "runtime",
]
