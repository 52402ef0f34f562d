"""Device profiles: every bundled file is valid, user files load, bad files fail clearly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from firmware_profiles import (
    BUNDLED_DIR,
    PROFILE_PATH_ENV,
    DeviceProfile,
    ProfileError,
    list_profiles,
    load_profile,
)

EXPECTED = {
    "jetson-nano",
    "jetson-orin-nano",
    "jetson-xavier-nx",
    "raspberry-pi-4",
    "raspberry-pi-5",
    "x86-laptop",
}
FIGURES = (
    "peak_fp32_gflops",
    "memory_mb",
    "idle_power_w",
    "max_power_w",
    "link_bandwidth_mbps",
    "radio_power_w",
    "cpu_cores",
)
GOOD = """\
name = "my-board"
description = "a board of my own"
peak_fp32_gflops = 10
memory_mb = 512
idle_power_w = 0.5
max_power_w = 2.5
link_bandwidth_mbps = 20.0
radio_power_w = 0.3
cpu_cores = 1

[sources]
memory_mb = "measured"
"""


@pytest.fixture(autouse=True)
def _no_user_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILE_PATH_ENV, raising=False)


def _write(directory: Path, text: str, stem: str = "my-board") -> Path:
    path = directory / f"{stem}.toml"
    path.write_text(text)
    return path


def test_bundled_profiles_are_listed() -> None:
    assert set(list_profiles()) >= EXPECTED


@pytest.mark.parametrize("name", sorted({p.stem for p in BUNDLED_DIR.glob("*.toml")}))
def test_bundled_profile_is_valid_and_sourced(name: str) -> None:
    profile = load_profile(name)
    assert isinstance(profile, DeviceProfile)
    assert profile.name == name
    assert 0 < profile.idle_power_w <= profile.max_power_w
    assert set(profile.sources) == set(FIGURES), "every figure needs its source"
    assert all(text.strip() for text in profile.sources.values())


def test_user_profile_by_path(tmp_path: Path) -> None:
    profile = load_profile(_write(tmp_path, GOOD))
    assert profile.name == "my-board"
    assert profile.peak_fp32_gflops == 10.0 and isinstance(profile.peak_fp32_gflops, float)
    assert profile.memory_mb == 512 and profile.cpu_cores == 1
    assert dict(profile.sources) == {"memory_mb": "measured"}
    assert load_profile(str(tmp_path / "my-board.toml")) == profile


def test_user_profile_via_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty, mine = tmp_path / "empty", tmp_path / "mine"
    empty.mkdir()
    mine.mkdir()
    _write(mine, GOOD)
    monkeypatch.setenv(PROFILE_PATH_ENV, os.pathsep.join(map(str, [empty, tmp_path / "no", mine])))
    assert "my-board" in list_profiles()
    assert set(list_profiles()) >= EXPECTED
    assert load_profile("my-board").memory_mb == 512


def test_user_directory_overrides_bundled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, GOOD.replace("my-board", "jetson-nano"), stem="jetson-nano")
    monkeypatch.setenv(PROFILE_PATH_ENV, str(tmp_path))
    assert load_profile("jetson-nano").memory_mb == 512


def _replace(line_start: str, new_line: str) -> str:
    lines = [new_line if line.startswith(line_start) else line for line in GOOD.splitlines()]
    return "\n".join(line for line in lines if line) + "\n"


BAD = {
    "missing field": (_replace("cpu_cores", ""), "'cpu_cores': missing"),
    "wrong type": (_replace("memory_mb", 'memory_mb = "512"'), "'memory_mb': expected int"),
    "float for int": (_replace("cpu_cores", "cpu_cores = 1.5"), "'cpu_cores': expected int"),
    "bool": (_replace("radio_power_w", "radio_power_w = true"), "'radio_power_w': expected"),
    "zero": (_replace("memory_mb", "memory_mb = 0"), "'memory_mb': must be a positive"),
    "negative": (_replace("radio_power_w", "radio_power_w = -1"), "'radio_power_w': must be"),
    "infinite": (_replace("peak_fp32", "peak_fp32_gflops = inf"), "'peak_fp32_gflops': must be"),
    "idle above max": (
        _replace("idle_power_w", "idle_power_w = 3"),
        "'idle_power_w': 3 W is above",
    ),
    "unknown field": (GOOD.replace("cpu_cores", "gpu = 1\ncpu_cores"), "'gpu': unknown field"),
    "bad name": (_replace("name", 'name = "My Board"'), "'name': 'My Board' is not"),
    "unknown source": (GOOD + 'gpu = "x"\n', "'sources.gpu': not a figure"),
    "source not text": (GOOD + "cpu_cores = 1\n", "'sources.cpu_cores': expected str"),
    "sources not a table": (
        _replace("[sources]", "").replace('memory_mb = "measured"', 'sources = "x"'),
        "'sources': expected a table",
    ),
    "not toml": ("name = \n", "not valid TOML"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_is_a_clear_profile_error(tmp_path: Path, case: str) -> None:
    text, expected = BAD[case]
    path = _write(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(path) in str(info.value)
    assert expected in str(info.value)


def test_missing_file_is_a_profile_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "nothing.toml")


def test_name_must_match_file_found_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, GOOD, stem="other-board")
    monkeypatch.setenv(PROFILE_PATH_ENV, str(tmp_path))
    with pytest.raises(ProfileError, match="does not match the file name"):
        load_profile("other-board")


def test_unknown_name_lists_known_profiles() -> None:
    with pytest.raises(ProfileError) as info:
        load_profile("no-such-board")
    message = str(info.value)
    assert "no-such-board" in message
    assert all(name in message for name in EXPECTED)
    assert PROFILE_PATH_ENV in message
