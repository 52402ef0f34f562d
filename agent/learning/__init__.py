"""The learning core: pure functions and small state objects over tensors, shared by the
simulator (`coordinator.simulate`), the networked agent (`agent.runtime`) and the
coordinator's aggregator, which is why a fleet on a network computes what the simulator
computes. It imports torch and numpy only (its config, `config` and `robust_rules`, not even
those): no network, clock, threads or files (tests/test_layering.py). docs/architecture.md
maps each step of ALGORITHMS.md to its module.

The names are loaded when first used (`lazy_loader`; they are listed in `__init__.pyi`): a
command that only reads the config's choices (`agent.learning.config`) does not load torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
