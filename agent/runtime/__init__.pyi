"""The networked agent's public names, for type checkers and `lazy_loader.attach_stub`."""

from . import checkpoint, codec
from .build import AgentRuntime
from .codec import (
    all_finite,
    decode_broadcast,
    decode_download,
    decode_state,
    decode_upload,
    divergence_message,
    encode_state,
    expected_delta_shapes,
    expected_shapes,
    model_message,
    values_sent,
)
from .inbox import Expected, Inbox
from .layer_server import LayerServer
from .session import RoundDriver, Run, Session, Timeouts, new_run_id, publish_telemetry

__all__ = [
    "AgentRuntime",
    "Expected",
    "Inbox",
    "LayerServer",
    "RoundDriver",
    "Run",
    "Session",
    "Timeouts",
    "all_finite",
    "checkpoint",
    "codec",
    "decode_broadcast",
    "decode_download",
    "decode_state",
    "decode_upload",
    "divergence_message",
    "encode_state",
    "expected_delta_shapes",
    "expected_shapes",
    "model_message",
    "new_run_id",
    "publish_telemetry",
    "values_sent",
]
