"""The wire protocol version carried by every message and every discovery record, and the
name of the distribution that ships edgefl (its `--version`, and the extras users install)."""

PROTOCOL_VERSION = 1

DISTRIBUTION = "edgefl-fleet"
"""The name on PyPI: "edgefl" there is another project. The commands keep their names."""
