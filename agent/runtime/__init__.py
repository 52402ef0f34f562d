"""The networked agent, by composition (`build.AgentRuntime` puts it together).

`session`: what every run shares (start barrier, statuses, checkpoints and resuming, early
stopping, lingering, exit); `decentralized` and `centralized`: a round driver per topology;
`wire_full`, `wire_delta`, `wire_layers`: one object per `--wire` format (`wire`: their
interface), the last with its `layer_server`; `inbox` and `mail`: what arrived; `codec` and
`checkpoint`: bytes on the wire and on disk. Nothing is imported here: `checkpoint` is used by
modules the rest imports.
"""
