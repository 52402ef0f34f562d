"""The wire protocol version carried by every message and every discovery record."""

PROTOCOL_VERSION = 1
