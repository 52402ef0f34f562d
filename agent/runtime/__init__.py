"""The networked agent, by composition (`AgentRuntime` puts it together).

`session`: what every run shares (start barrier, statuses, checkpoints and resuming, early
stopping, lingering, exit); `decentralized` and `centralized`: a round driver per topology;
`wire_full`, `wire_delta`, `wire_layers`: one object per `--wire` format (`wire`: their
interface), the last with its `layer_server`; `inbox` and `mail`: what arrived; `codec` and
`checkpoint`: bytes on the wire and on disk.
"""

from __future__ import annotations

from agent.runtime import checkpoint, codec
from agent.runtime.build import AgentRuntime
from agent.runtime.codec import (
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
from agent.runtime.inbox import Expected, Inbox
from agent.runtime.layer_server import LayerServer
from agent.runtime.session import (
    RoundDriver,
    Run,
    Session,
    Timeouts,
    new_run_id,
    publish_telemetry,
)

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
