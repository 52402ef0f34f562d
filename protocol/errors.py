"""The one error type every decoder in this package raises on bad input."""


class ProtocolError(ValueError):
    """Raised for any malformed, oversized, non-finite or unsupported wire data.

    Decoders never raise anything else on untrusted bytes, so a receiver can catch this
    one type, log the reason, count it and carry on without corrupting its state.
    """
