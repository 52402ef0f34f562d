"""Load and validate device profiles: the figures budgets, emulation and the energy model use.

Profiles are plain TOML so that a user can describe their own board without writing code:
bundled ones live next to this module, user ones in the directories named by
EDGEFL_PROFILE_PATH (searched first, so a user can override a bundled profile with figures
measured on their own device) or at any path given directly.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, get_type_hints

from agent.device.availability import Availability

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PROFILE_PATH_ENV = "EDGEFL_PROFILE_PATH"
BUNDLED_DIR = Path(__file__).resolve().parent
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


class ProfileError(ValueError):
    """A profile that cannot be found or is invalid; the message names the file and field."""


@dataclass(frozen=True)
class DeviceProfile:
    """One device's compute, memory, power and link figures (units in the field names).

    `peak_fp32_gflops` is the board's main compute, the one simulate and emulate model: its
    GPU's where the board has one that trains (a Jetson), else its CPU's. Such a board also
    gives `cpu_peak_fp32_gflops`, so that an agent told to train on the CPU budgets with what
    it really uses (`peak_for`); a CPU-only board leaves it out.
    """

    name: str
    description: str
    peak_fp32_gflops: float
    memory_mb: int
    idle_power_w: float
    max_power_w: float
    link_bandwidth_mbps: float
    radio_power_w: float
    cpu_cores: int
    cpu_peak_fp32_gflops: float | None = None
    availability: Availability | None = None
    """When the board is online (its `[availability]` table): None, always."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_gpu(self) -> bool:
        """Whether `peak_fp32_gflops` is a GPU's (the profile gives its CPU's apart)."""
        return self.cpu_peak_fp32_gflops is not None

    def peak_for(self, device_type: str) -> float:
        """Peak fp32 GFLOPS of the compute an agent trains on: "cuda" (the GPU) or "cpu".

        Raises ValueError for "cuda" on a board whose profile names no GPU, and for any other
        device type.
        """
        if device_type == "cpu":
            if self.cpu_peak_fp32_gflops is not None:
                return self.cpu_peak_fp32_gflops
            return self.peak_fp32_gflops
        if device_type == "cuda":
            if not self.has_gpu:
                raise ValueError(
                    f"device profile {self.name!r} has no GPU (its peak_fp32_gflops is the "
                    "CPU's; a GPU board also gives cpu_peak_fp32_gflops): train on the cpu"
                )
            return self.peak_fp32_gflops
        raise ValueError(f"unknown compute {device_type!r}; expected 'cpu' or 'cuda'")


_OPTIONAL: dict[str, type] = {"cpu_peak_fp32_gflops": float}
_REQUIRED: dict[str, type] = {
    name: kind
    for name, kind in get_type_hints(DeviceProfile).items()
    if name not in ("sources", "availability") and name not in _OPTIONAL
}
_FIGURES = {name: kind for name, kind in (_REQUIRED | _OPTIONAL).items() if kind in (int, float)}
_TABLES = ("sources", "availability")
_ACCEPTED = {str: (str,), int: (int,), float: (int, float)}  # TOML writes 10 for 10.0


def _check(data: Mapping[str, Any], where: str) -> DeviceProfile:
    def fail(key: str, problem: str) -> ProfileError:
        return ProfileError(f"{where}: field {key!r}: {problem}")

    for key in data:
        if key not in _REQUIRED and key not in _OPTIONAL and key not in _TABLES:
            raise fail(
                key,
                f"unknown field; expected {', '.join(_REQUIRED)}, optionally "
                f"{', '.join(_OPTIONAL)}, [availability] and [sources]",
            )
    for key, kind in (_REQUIRED | _OPTIONAL).items():
        if key not in data:
            if key in _REQUIRED:
                raise fail(key, "missing")
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, _ACCEPTED[kind]):
            raise fail(key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        # A figure passed the isinstance check above; naming int | float here tells mypy.
        if key in _FIGURES and not (
            isinstance(value, int | float) and value > 0 and (kind is int or math.isfinite(value))
        ):
            raise fail(key, f"must be a positive finite number, got {value!r}")
    if not _NAME.match(data["name"]):
        raise fail("name", f"{data['name']!r} is not 1-64 of a-z 0-9 _ . - (it goes on the wire)")
    if data["idle_power_w"] > data["max_power_w"]:
        raise fail(
            "idle_power_w",
            f"{data['idle_power_w']} W is above max_power_w {data['max_power_w']} W",
        )
    sources = data.get("sources", {})
    if not isinstance(sources, dict):
        raise fail("sources", "expected a table of field = source text")
    for key, text in sources.items():
        if key not in _FIGURES:
            raise fail(f"sources.{key}", f"not a figure; expected one of {', '.join(_FIGURES)}")
        if not isinstance(text, str):
            raise fail(f"sources.{key}", f"expected str, got {type(text).__name__}")
    # Each figure converted to its field's own type (int or float), from the dataclass hints.
    figures: dict[str, Any] = {
        key: kind(data[key]) for key, kind in _FIGURES.items() if key in data
    }
    return DeviceProfile(
        name=data["name"],
        description=data["description"],
        availability=_availability(data, where),
        sources=MappingProxyType(dict(sources)),
        **figures,
    )


def _availability(data: Mapping[str, Any], where: str) -> Availability | None:
    """The profile's `[availability]` table read, or None without one."""
    table = data.get("availability")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ProfileError(f"{where}: field 'availability': expected a table of figures")
    try:
        return Availability.of_table(table, where)
    except ValueError as exc:
        raise ProfileError(str(exc)) from None


def _search_dirs() -> list[Path]:
    user = [Path(d) for d in os.environ.get(PROFILE_PATH_ENV, "").split(os.pathsep) if d]
    return [*user, BUNDLED_DIR]


def list_profiles() -> list[str]:
    """Names of the bundled profiles and of those in EDGEFL_PROFILE_PATH."""
    return sorted({p.stem for d in _search_dirs() if d.is_dir() for p in d.glob("*.toml")})


def _load_file(path: Path) -> DeviceProfile:
    try:
        with path.open("rb") as stream:
            data = tomllib.load(stream)
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    return _check(data, str(path))


def load_profile(name_or_path: str | os.PathLike[str]) -> DeviceProfile:
    """Load a profile by name (EDGEFL_PROFILE_PATH, then bundled) or by a file's path.

    Anything that is not a plain name (it holds a path separator or ends in .toml) is a path.
    """
    text = os.fspath(name_or_path)
    if not _NAME.match(text) or text.endswith(".toml"):
        return _load_file(Path(text))
    for directory in _search_dirs():
        candidate = directory / f"{text}.toml"
        if candidate.is_file():
            profile = _load_file(candidate)
            if profile.name != text:
                raise ProfileError(
                    f"{candidate}: field 'name': {profile.name!r} does not match the file name"
                )
            return profile
    raise ProfileError(
        f"unknown device profile {text!r}; known profiles: {', '.join(list_profiles())} "
        f"(add your own by path or in a directory listed in {PROFILE_PATH_ENV})"
    )
