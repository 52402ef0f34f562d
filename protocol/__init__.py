"""The wire format and transport of edgefl; knows nothing of training.

The names other packages use can be imported from here (`from protocol import
MqttTransport`) as well as from their modules. They are loaded when first used
(`lazy_loader`; they are listed in `__init__.pyi`): the modules pull in paho, zeroconf and
click, and the command-line tools import discovery only when mDNS is asked for, which an
eager import here would undo.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
