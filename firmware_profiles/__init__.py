"""Device profiles as data (TOML) and their loader; see loader.py."""

from firmware_profiles.loader import (
    BUNDLED_DIR,
    PROFILE_PATH_ENV,
    DeviceProfile,
    ProfileError,
    list_profiles,
    load_profile,
)

__all__ = [
    "BUNDLED_DIR",
    "PROFILE_PATH_ENV",
    "DeviceProfile",
    "ProfileError",
    "list_profiles",
    "load_profile",
]
