"""The device side of edgefl: `learning` (the learning core the simulator, the agent and the
aggregator share), `device` (budget and throttle), `runtime` (the networked agent), `report`
(the round record and run summary), `experiment` (a run's config, torch-free), `data` and
`workload` (the experiment mode's datasets and each agent's workload), `files` (atomic
writes), `model_store` (the models a device keeps), `onnx_export` and `onnx_model` (the
personalized model exported, and served without torch) and `cli` (`edge-agent`). Each
subpackage states its own public API in its `__all__`.
"""

__all__ = [
    "cli",
    "data",
    "device",
    "experiment",
    "files",
    "learning",
    "model_store",
    "onnx_export",
    "onnx_model",
    "options",
    "report",
    "runtime",
    "workload",
]
