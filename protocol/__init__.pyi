"""The protocol package's public names, for type checkers and `lazy_loader.attach_stub`."""

from . import messages, topics
from .chunking import (
    DEFAULT_CHUNK_SIZE,
    FRAME_VERSION,
    MAGIC,
    FrameError,
    Reassembler,
    fits_one_frame,
    split,
)
from .cli import (
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
from .discovery import (
    AGENT_SERVICE,
    AgentAdvert,
    BrokerAdvert,
    Discovery,
    choose_broker,
    discover_broker,
)
from .errors import ProtocolError
from .limits import DEFAULT_LIMITS, Limits
from .masks import MaskKind, bitmap_size, decode_mask, elias_fano_size, encode_mask
from .membership import DuplicateMember, Identity, connect, leave
from .memory import MemoryBroker, MemoryTransport
from .mqtt import BrokerAddress, MqttTransport, PublishQueueFull, TlsOptions, TransportOptions
from .signing import FleetKey, MemberKeys, Signer, member_keys, read_keys
from .tensors import DTYPES, DecodedTensor, decode_tensors, encode_tensors, lower_bound_bytes
from .transport import Transport
from .version import PROTOCOL_VERSION

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
