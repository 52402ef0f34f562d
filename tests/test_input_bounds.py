"""Sane input ranges and bounded data loading: every numeric option has a range, a value
outside it (nan, inf, a typo's 1e300) is a one-line error naming the option on the command
line and in a run file, and the loaders refuse data beyond the size limit before they read
or decompress it: a 2 GB csv, a 2 MB npz that expands to 2 GiB, a folder of too many images.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import tracemalloc
import typing
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from agent.data import MAX_DATA_ENV, load_dataset
from agent.experiment import RANGES, ExperimentConfig
from agent.learning import StrategyConfig
from agent.own_data import load_own_data
from agent.runfile import load_run_file
from coordinator.cli import main as coordinator

MIB = 1 << 20
LOADING_BUDGET = 64 * MIB
"""What refusing a file may allocate at most (tracemalloc's peak, numpy's buffers included):
the data refused here would take gigabytes."""

BAD_VALUES = [
    ("lr", "nan", "--lr must be a finite number, got nan"),
    ("lr", "inf", "--lr must be a finite number, got inf"),
    ("lr", "-1e300", "--lr must be in [0, 10], got -1e+300"),
    ("lr", "1e12", "--lr must be in [0, 10], got 1000000000000.0"),
    ("epochs", "1000000000", "--epochs must be <= 10,000, got 1,000,000,000"),
    ("rounds", "0", "--rounds must be >= 1, got 0"),
    ("batch-size", "100000000", "--batch-size must be <= 1,000,000, got 100,000,000"),
    ("agents", "1000000", "--agents must be <= 10,000, got 1,000,000"),
    ("seed", "-1", "--seed must be >= 0, got -1"),
    ("momentum", "1", "--momentum must be in [0, 1), got 1.0"),
    ("weight-decay", "nan", "--weight-decay must be a finite number, got nan"),
    ("round-time-s", "inf", "--round-time-s must be a finite number, got inf"),
    ("density", "0", "--density must be in (0, 1], got 0.0"),
]
"""(option, value on the command line, what the error says)."""


def one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(coordinator, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize(("option", "value", "message"), BAD_VALUES)
def test_a_value_out_of_range_is_a_one_line_error_on_the_command_line(
    option: str, value: str, message: str
) -> None:
    line = one_line_error(["simulate", "--dataset", "digits", f"--{option}", value])
    assert line == f"Error: {message}"


@pytest.mark.parametrize(("option", "value", "message"), BAD_VALUES)
def test_a_value_out_of_range_is_a_one_line_error_in_a_run_file(
    tmp_path: Path, option: str, value: str, message: str
) -> None:
    key = option.replace("-", "_")
    toml = {"nan": "nan", "inf": "inf"}.get(value, value)
    agents = "" if key == "agents" else "agents = 4\n"
    path = tmp_path / "run.toml"
    path.write_text(f"[run]\n{agents}{key} = {toml}\n")
    line = one_line_error(["run", str(path)])
    assert line == f"Error: {path}: {message.replace(f'--{option}', key)}", line


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("round_timeout", "1e9", "round_timeout must be at most 604,800 seconds (a week)"),
        ("vote_timeout", "inf", "vote_timeout must be a number of seconds, got inf"),
        ("join_timeout", "nan", "join_timeout must be a number of seconds, got nan"),
        ("linger", "-1", "linger must be >= 0 seconds, got -1"),
        ("min_samples", "1", "min_samples must be >= 3, got 1"),
        ("input_shape", "[3, 4096, 4096]", "holds 50,331,648 values a sample, more than"),
    ],
)
def test_run_file_keys_have_ranges(tmp_path: Path, key: str, value: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f"[run]\nagents = 4\n{key} = {value}\n")
    with pytest.raises(ValueError, match="^" + str(path)) as refused:
        load_run_file(path)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_every_numeric_option_has_a_range() -> None:
    """A numeric field added later without a range would take nan and 1e300 again."""
    numeric = set()
    for cls in (ExperimentConfig, StrategyConfig):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kinds = set(typing.get_args(hints[field.name]) or (hints[field.name],))
            if kinds & {int, float}:
                numeric.add(field.name)
    assert numeric - set(RANGES) == {"attackers"}  # 0..agents - 1: checked with agents
    assert set(RANGES) <= numeric


def test_lr_zero_freezes_a_model_and_stays_allowed() -> None:
    """Tests freeze models with lr 0 on purpose: the range starts at 0."""
    assert RANGES["lr"].problem("--lr", 0.0) is None


# ---------------------------------------------------------------- data beyond the limit


def within_budget(load: Callable[[], object]) -> str:
    """The error `load` raises, having allocated at most LOADING_BUDGET on the way."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            load()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < LOADING_BUDGET, f"allocated {peak / MIB:.0f} MiB before refusing"
    message = str(refused.value)
    assert "\n" not in message
    return message


def zip_bomb(path: Path, gib: int = 2) -> Path:
    """An .npz of about 2 MB whose x.npy expands to `gib` GiB of float32 zeros: a valid
    archive (its CRC right), deflated 16 MiB at a time with full flushes so every block
    compresses alike and is made once."""
    zeros = 1 << 24
    blocks = (gib << 30) // zeros
    header = io.BytesIO()
    shape = (blocks * zeros // 4 // 256, 256)
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": shape}
    )
    head = header.getvalue()
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(bytes(zeros)) + deflate.flush(zlib.Z_FULL_FLUSH)
    data = first + block * blocks + deflate.flush()
    crc = zlib.crc32(head)
    for _ in range(blocks):
        crc = zlib.crc32(bytes(zeros), crc)
    size, name = len(head) + blocks * zeros, b"x.npy"
    local = struct.pack(
        "<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(data), size, len(name), 0
    )
    central = struct.pack(
        "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(data), size, len(name),
        0, 0, 0, 0, 0, 0,
    )  # fmt: skip
    end = struct.pack(
        "<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central + name), len(local + name + data), 0
    )
    path.write_bytes(local + name + data + central + name + end)
    return path


def test_an_npz_that_expands_to_gigabytes_is_refused_before_it_is_decompressed(
    tmp_path: Path,
) -> None:
    bomb = zip_bomb(tmp_path / "bomb.npz")
    assert bomb.stat().st_size < 3 * MIB
    for load in (lambda: load_own_data(bomb), lambda: load_dataset(f"npz:{bomb}", seed=1)):
        message = within_budget(load)
        assert message.startswith(f"{bomb}: its arrays take 2,048 MB, more than the 1,024 MB")
        assert MAX_DATA_ENV in message


def test_an_npz_header_that_claims_more_than_its_member_holds_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "liar.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (1000, 3)}
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue() + bytes(48))  # 4 x 3, not 1000 x 3
    message = within_budget(lambda: load_own_data(path))
    assert message == f"{path}: x declares 12,000 bytes but holds 176"


def test_a_csv_beyond_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A 2 GB csv (sparse: it takes no disk) costs its error and nothing more."""
    path = tmp_path / "big.csv"
    with open(path, "wb") as f:
        f.write(b"a,b,label\n")
        f.truncate(2 * 10**9)
    message = within_budget(lambda: load_own_data(path))
    assert message.startswith(f"{path}: the file's contents take 1,907 MB, more than the 1,024")
    assert MAX_DATA_ENV in message


def test_a_csv_within_the_limit_is_read_as_float32_within_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short cells ("0,") take 4 bytes each as float32, twice their text: the limit holds
    for what is read, not only for the file."""
    path = tmp_path / "dense.csv"
    row = ",".join(["0"] * 99) + ",1\n"
    path.write_text("label," + ",".join(f"f{i}" for i in range(99)) + "\n" + row * 300)
    monkeypatch.setenv(MAX_DATA_ENV, str(1.5 * path.stat().st_size / MIB))
    message = within_budget(lambda: load_own_data(path))
    assert message.startswith(f"{path}: its features as float32 take more than the 0.086 MB")
    monkeypatch.setenv(MAX_DATA_ENV, "1")
    data = load_own_data(path)
    assert data.x.shape == (300, 99) and data.x.dtype == np.float32


def test_too_many_images_are_refused_before_any_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files are not even images: the count alone refuses them."""
    for label in ("0", "1"):
        (tmp_path / label).mkdir()
        for n in range(40):
            (tmp_path / label / f"{n}.png").write_bytes(b"not an image")
    monkeypatch.setenv(MAX_DATA_ENV, "0.5")  # 80 images of 3x32x32 float32: 0.9 MB
    message = within_budget(lambda: load_own_data(tmp_path))
    assert message.startswith(f"{tmp_path}: 80 images as float32 take 0.94 MB, more than the 0.5")


def test_an_image_of_too_many_pixels_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    """8192 x 8193 black pixels: a 65 KB file that decodes to 200 MB as RGB."""
    from PIL import Image

    for label in ("0", "1"):
        (tmp_path / label).mkdir()
        Image.new("L", (8, 8)).save(tmp_path / label / "small.png")
    big = tmp_path / "1" / "big.png"
    Image.new("L", (8192, 8193)).save(big)
    message = within_budget(lambda: load_own_data(tmp_path))
    assert message == f"{big}: 8192x8193 pixels, more than the 67,108,864 an image may have"


@pytest.mark.parametrize("value", ["many", "0", "-3", "nan"])
def test_a_bad_data_limit_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    path = tmp_path / "small.csv"
    path.write_text("label,f\n1,2\n")
    monkeypatch.setenv(MAX_DATA_ENV, value)
    with pytest.raises(ValueError, match=f"^{MAX_DATA_ENV}='{value}': expected a positive"):
        load_own_data(path)
