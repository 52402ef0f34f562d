"""The wire protocol version carried by every message and every discovery record, and the
name of the distribution that ships edgefl (its `--version`, and the extras users install)."""

PROTOCOL_VERSION = 2
"""2: presences carry `at` and probe answers `answers` (replay protection); a build of
version 1 rejects them, so a fleet upgrades every member together."""

DISTRIBUTION = "edgefl-fleet"
"""The name on PyPI: "edgefl" there is another project. The commands keep their names."""
