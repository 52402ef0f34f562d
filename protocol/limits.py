"""Size limits that decoders check before they allocate anything."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what a decoder accepts from the wire.

    The defaults fit models up to a few hundred million parameters; a deployment with
    smaller devices can tighten them so a hostile peer cannot make an agent allocate
    more memory than it has.
    """

    max_message_bytes: int = 1 << 31
    max_tensors: int = 4096
    max_tensor_elements: int = 1 << 28
    max_total_elements: int = 1 << 29
    max_ndim: int = 8
    max_name_length: int = 256
    max_chunks: int = 1 << 16


DEFAULT_LIMITS = Limits()
