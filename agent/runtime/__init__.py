"""The networked agent, by composition (`AgentRuntime` puts it together).

`session`: what every run shares (start barrier, statuses, checkpoints and resuming, early
stopping, lingering, exit); `decentralized` and `centralized`: a round driver per topology;
`wire_full`, `wire_delta`, `wire_layers`: one object per `--wire` format (`wire`: their
interface), the last with its `layer_server`; `inbox` and `mail`: what arrived; `codec` and
`checkpoint`: bytes on the wire and on disk.

The names are loaded when first used (`lazy_loader`; they are listed in `__init__.pyi`).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
