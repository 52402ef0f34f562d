"""The wire format and transport of edgefl; knows nothing of training.

The names other packages use can be imported from here (`from protocol import
MqttTransport`) as well as from their modules. They are loaded lazily, on first use: the
modules pull in paho, zeroconf and click, and the command-line tools import discovery only
when mDNS is asked for, which an eager import here would undo.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protocol import messages, topics
    from protocol.chunking import (
        DEFAULT_CHUNK_SIZE,
        FRAME_VERSION,
        MAGIC,
        FrameError,
        Reassembler,
        fits_one_frame,
        split,
    )
    from protocol.cli import (
        BROKER,
        NAME,
        BrokerSettings,
        ConfigError,
        broker_options,
        logging_options,
        read_key,
        say,
        stop_on_signal,
        version_option,
        wait_for,
    )
    from protocol.discovery import (
        AGENT_SERVICE,
        AgentAdvert,
        BrokerAdvert,
        Discovery,
        choose_broker,
        discover_broker,
    )
    from protocol.errors import ProtocolError
    from protocol.limits import DEFAULT_LIMITS, Limits
    from protocol.masks import MaskKind, bitmap_size, decode_mask, elias_fano_size, encode_mask
    from protocol.membership import DuplicateMember, Identity, connect, leave
    from protocol.memory import MemoryBroker, MemoryTransport
    from protocol.mqtt import (
        BrokerAddress,
        MqttTransport,
        PublishQueueFull,
        TlsOptions,
        TransportOptions,
    )
    from protocol.signing import FleetKey, MemberKeys, Signer, member_keys, read_keys
    from protocol.tensors import (
        DTYPES,
        DecodedTensor,
        decode_tensors,
        encode_tensors,
        lower_bound_bytes,
    )
    from protocol.transport import Transport
    from protocol.version import PROTOCOL_VERSION

_EXPORTS: dict[str, tuple[str, ...]] = {
    "protocol.chunking": (
        "DEFAULT_CHUNK_SIZE",
        "FRAME_VERSION",
        "MAGIC",
        "FrameError",
        "Reassembler",
        "fits_one_frame",
        "split",
    ),
    "protocol.cli": (
        "BROKER",
        "NAME",
        "BrokerSettings",
        "ConfigError",
        "broker_options",
        "logging_options",
        "read_key",
        "say",
        "stop_on_signal",
        "version_option",
        "wait_for",
    ),
    "protocol.discovery": (
        "AGENT_SERVICE",
        "AgentAdvert",
        "BrokerAdvert",
        "Discovery",
        "choose_broker",
        "discover_broker",
    ),
    "protocol.errors": ("ProtocolError",),
    "protocol.limits": ("DEFAULT_LIMITS", "Limits"),
    "protocol.masks": ("MaskKind", "bitmap_size", "decode_mask", "elias_fano_size", "encode_mask"),
    "protocol.membership": ("DuplicateMember", "Identity", "connect", "leave"),
    "protocol.memory": ("MemoryBroker", "MemoryTransport"),
    "protocol.mqtt": (
        "BrokerAddress",
        "MqttTransport",
        "PublishQueueFull",
        "TlsOptions",
        "TransportOptions",
    ),
    "protocol.signing": ("FleetKey", "MemberKeys", "Signer", "member_keys", "read_keys"),
    "protocol.tensors": (
        "DTYPES",
        "DecodedTensor",
        "decode_tensors",
        "encode_tensors",
        "lower_bound_bytes",
    ),
    "protocol.transport": ("Transport",),
    "protocol.version": ("PROTOCOL_VERSION",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "AGENT_SERVICE",
    "BROKER",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LIMITS",
    "DTYPES",
    "FRAME_VERSION",
    "MAGIC",
    "NAME",
    "PROTOCOL_VERSION",
    "AgentAdvert",
    "BrokerAddress",
    "BrokerAdvert",
    "BrokerSettings",
    "ConfigError",
    "DecodedTensor",
    "Discovery",
    "DuplicateMember",
    "FleetKey",
    "FrameError",
    "Identity",
    "Limits",
    "MaskKind",
    "MemberKeys",
    "MemoryBroker",
    "MemoryTransport",
    "MqttTransport",
    "ProtocolError",
    "PublishQueueFull",
    "Reassembler",
    "Signer",
    "TlsOptions",
    "Transport",
    "TransportOptions",
    "bitmap_size",
    "broker_options",
    "choose_broker",
    "connect",
    "decode_mask",
    "decode_tensors",
    "discover_broker",
    "elias_fano_size",
    "encode_mask",
    "encode_tensors",
    "fits_one_frame",
    "leave",
    "logging_options",
    "lower_bound_bytes",
    "member_keys",
    "messages",
    "read_key",
    "read_keys",
    "say",
    "split",
    "stop_on_signal",
    "topics",
    "version_option",
    "wait_for",
]


def __getattr__(name: str) -> Any:
    """Import the module that defines `name` on first use (PEP 562)."""
    module = _MODULE_OF.get(name)
    if module is None:
        # Submodules (`from protocol import messages`) are found by the import system after
        # this AttributeError, as for any package.
        raise AttributeError(f"module 'protocol' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
