"""The device side of an agent: its resource budget p_k (`budget`), the emulation
throttle that makes a host take its profile's time (`throttle`) and the torch device it
trains on (`compute`).

The names are loaded when first used (`lazy_loader`, from `__init__.pyi`).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
