"""Shamir's secret sharing of 16-byte secrets over the prime field of p = 2^127 - 1, for
secure aggregation's seeds (`protocol.secagg`).

Why not pycryptodome's `Shamir` (GF(2^128)), which this replaced: its field product is
pure-Python carry-less multiplication (8.5 us by a small holder index, 360 us for two full
elements), and it was 99% of a device's and most of the coordinator's CPU a round
(`bench/secagg.py`: 0.10 s a device at 100 members, where a device trains in 15 ms). Over a
Mersenne prime a product is one native big-integer multiplication and reduction (0.2 us),
and an inverse `pow(x, -1, p)` (5 us): the same scheme, the same sizes on the wire (a share
is below 2^127: 16 bytes), some 50 times less CPU. Secrets must be below p: `secret_seed`
draws them so (127 bits of entropy).

A share is (x, y) with x a holder's positive index and y = f(x) for a polynomial f of degree
t - 1 whose constant term is the secret and whose other coefficients are uniform in the
field: any t shares give the secret (Lagrange at 0), any t - 1 are uniform and say nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

PRIME = 2**127 - 1
"""The field's order: a Mersenne prime, so every 16-byte share below it fits 16 bytes."""
SECRET_BYTES = 16


class ShamirError(ValueError):
    """Shares that cannot rebuild a secret: repeated holders, or a value outside the field."""


def secret_seed(random: Callable[[int], bytes]) -> bytes:
    """A uniform 16-byte secret below PRIME from `random` (e.g. os.urandom): its top bit
    cleared, and the one value equal to PRIME mapped to 0."""
    value = (int.from_bytes(random(SECRET_BYTES), "big") >> 1) % PRIME
    return value.to_bytes(SECRET_BYTES, "big")


def split(
    secret: bytes, threshold: int, holders: Iterable[int], random: Callable[[int], bytes]
) -> dict[int, bytes]:
    """Shares of `secret` for each x in `holders`, any `threshold` of which rebuild it."""
    value = _element(secret)
    # 32 random bytes reduced mod p: uniform within 2^-128
    coefficients = [value] + [
        int.from_bytes(random(32), "big") % PRIME for _ in range(threshold - 1)
    ]
    shares = {}
    for x in holders:
        if not 0 < x < PRIME:
            raise ShamirError(f"holder index {x} is outside the field")
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y.to_bytes(SECRET_BYTES, "big")
    return shares


@functools.lru_cache(maxsize=256)
def lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """The Lagrange coefficients at 0 of the points `xs`: prod_{m != j} x_m / (x_m - x_j),
    each with one inverse (cached: the coordinator rebuilds many secrets from one set of
    holders when the graph is complete)."""
    coefficients = []
    for j, x_j in enumerate(xs):
        numerator, denominator = 1, 1
        for m, x_m in enumerate(xs):
            if m != j:
                numerator = numerator * x_m % PRIME
                denominator = denominator * (x_m - x_j) % PRIME
        coefficients.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return tuple(coefficients)


def combine(shares: Sequence[tuple[int, bytes]]) -> bytes:
    """The secret of `shares` (x, y): exact for `threshold` or more shares of one split."""
    xs = tuple(x for x, _ in shares)
    if len(set(xs)) != len(xs):
        raise ShamirError("two shares of one holder")
    total = 0
    for coefficient, (_, y) in zip(lagrange_at_zero(xs), shares, strict=True):
        total += coefficient * _element(y)
    return (total % PRIME).to_bytes(SECRET_BYTES, "big")


def _element(data: bytes) -> int:
    value = int.from_bytes(data, "big")
    if len(data) != SECRET_BYTES or value >= PRIME:
        raise ShamirError("a secret or share is not 16 bytes below 2^127 - 1")
    return value
