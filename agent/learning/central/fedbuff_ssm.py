"""FedBuff-SSM: FedAdam-SSM's participant round feeding FedBuff's buffered server step.

A participant trains as in FedAdam-SSM (local Adam from the global weights and both moments,
ALGORITHMS.md 3) and uploads the deltas of all three under one shared top-k mask, tagged with
the version it trained from. The server's buffer (`fedbuff.Buffer`) takes each upload's three
deltas as they come, staleness-weighted, and applies their sum over K to the weights and to
both moments (`fedbuff.server_step`).

Why a version carries the whole state, dense: FedAdam-SSM's broadcasts are deltas of W, M and
V, which only a device holding the previous version can apply; an asynchronous device skips
versions (it slept, or trained through several), and the retained topic keeps only the
newest. Local Adam starts from the server's moments (that is what the SSM upload's moment
deltas are taken against), so the device needs M and V as well as W: each version's retained
message is all three, and a device that was behind takes it as it is (`receive`). The
sparse upload, the paper's saving, is kept; the download is three times a model's size.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.learning.central.base import (
    Aggregate,
    Layout,
    Payload,
    ServerState,
    Upload,
)
from agent.learning.central.fedadam import FedAdamSSM, moment_deltas, moment_layout
from agent.learning.central.fedbuff import one_buffer
from agent.learning.model_facts import ModelFacts
from agent.learning.sparse import State


class FedBuffSSM(FedAdamSSM):
    """FedAdam-SSM's local round and sparse upload; the buffer's server step; whole-state
    versions."""

    name = "fedbuff-ssm"

    def update_delta(self, upload: Upload, base: State) -> ServerState:
        """The three deltas the upload carries (already taken against its base version)."""
        dw, dm, dv = moment_deltas(upload.payload)
        return ServerState(dw, dm, dv)

    def version_payload(self, server: ServerState) -> Payload:
        """A version's retained message: the parameters and both moments, dense (`w:`, `m:`,
        `v:` of each parameter; a model's buffers stay on each device)."""
        assert server.m is not None and server.v is not None
        names = server.m
        parts = {"w": {n: server.weights[n] for n in names}, "m": server.m, "v": server.v}
        return Payload({f"{p}:{n}": t for p, s in parts.items() for n, t in s.items()})

    def aggregate(
        self, learner: ModelFacts, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        """One buffer of every upload, none stale (`fedbuff.one_buffer`)."""
        return one_buffer(self, server, uploads)

    def receive(self, view: ServerState, broadcast: Payload) -> ServerState:
        """The version as it is: its parameters over the view's (buffers stay), its moments."""
        parts: dict[str, State] = {"w": {}, "m": {}, "v": {}}
        for name, tensor in broadcast.weights.items():
            prefix, _, tensor_name = name.partition(":")
            parts[prefix][tensor_name] = tensor
        return ServerState({**view.weights, **parts["w"]}, parts["m"], parts["v"])

    def broadcast_layout(self, learner: ModelFacts) -> Layout | None:
        return moment_layout(learner)
