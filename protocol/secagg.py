"""Secure aggregation (Bonawitz et al. 2017, the all-to-all form of Flower's SecAgg+): the
coordinator learns the sum of the participants' vectors and nothing of any one of them.
Pure: no training, no transport, no clock; a round's messages are moved by the runtime
(`agent.runtime.secure_rounds`, `coordinator.secure_sum`) or in one process
(`sum_in_process`, for `coordinator simulate` and the tests). It lives in `protocol` because
it is wire-level cryptography over integer vectors, beside `protocol.signing`.

A round among the roster U1 (every step's senders are the next step's cohort):

    advertise  each client makes two X25519 key pairs: one to encrypt shares (c), one whose
               agreement seeds the pairwise masks (s, derived from a 16-byte seed); it
               advertises both public keys and its weight (sample count)
    share      it Shamir-splits its self-mask seed b and its mask-key seed among U1
               (threshold t, pycryptodome over GF(2^128)), and encrypts each pair of shares
               for its holder (AES-GCM under HKDF(X25519(c_u, c_v))): the coordinator that
               relays them cannot read them. U2: who shared.
    mask       y_u = q(a_u x_u) + PRG(b_u) + sum_{v in U2, v > u} PRG(s_uv)
               - sum_{v in U2, v < u} PRG(s_uv) (mod 2^32): the pairwise masks cancel in the
               sum, the self mask hides y_u even from whoever learns s_uv of a dropped peer.
               U3: who uploaded y.
    unmask     each survivor reveals, for every member of U3, its share of b, and for every
               member of U2 - U3, its share of the mask-key seed (never both for one member:
               `Client.reveal` refuses), so the coordinator removes the self masks of U3 and
               the dropped members' pairwise masks, and is left with sum_{U3} q(a_u x_u).

The PRG is ChaCha20's keystream (`cryptography`) under a key derived by HKDF: a
cryptographic stream cipher, unlike numpy's PCG64/Philox, whose outputs predict the rest of
the stream; it expands 400 kB in about 0.1 ms here, as fast as numpy's generators.

Quantization: x_u is scaled by a_u = w_u / W (W: the weights of U1), clipped to
[-CLIP_RANGE, CLIP_RANGE] and rounded to a multiple of 1 / SCALE; the sum of |U3| such
values has magnitude at most CLIP_RANGE + |U3| / (2 SCALE) < 2^31, so it never wraps in the
ring of 2^32 (`quantization_bound`: its error per entry is at most |U3| / (2 SCALE)).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

RING_BITS = 32
"""Masked values are integers modulo 2^32: as many bytes on the wire as a float32."""
CLIP_RANGE = 8.0
"""Each weighted entry a_u x_u is clipped to [-CLIP_RANGE, CLIP_RANGE] before quantization."""
SCALE = 2**27
"""Fixed-point scale: CLIP_RANGE * SCALE = 2^30 leaves 2^30 for the rounding of up to 2^31
summands before the sum would wrap."""
MIN_MEMBERS = 2
"""The fewest members a sum is taken over: the sum of one member is its vector."""
DROPOUT = 0.3
"""The share of U1 that may drop at any step while the round still completes (`threshold`)."""
_SEED_BYTES = 16
"""Shamir (pycryptodome) shares 16-byte secrets: the self-mask seed and the mask-key seed."""
_NONCE_BYTES = 12
_SHARE_PLAINTEXT = 3 * _SEED_BYTES
"""A holder's index, then its share of b and its share of the mask-key seed (16 bytes each)."""


class SecAggError(ValueError):
    """A round that cannot go on: too few members left, or a malformed or forged message."""


def _shamir() -> Any:
    """pycryptodome's Shamir, imported when a round first shares (the `secagg` extra)."""
    from Crypto.Protocol.SecretSharing import Shamir

    return Shamir


def threshold(members: int) -> int:
    """Shares needed to reconstruct a secret among `members`: a majority (so that no minority
    of members and the coordinator together learn both secrets of one member), and at most
    70% of them, so that the round survives DROPOUT of them dropping."""
    return max(members // 2 + 1, (7 * members) // 10, 1)


def quantize(values: np.ndarray) -> tuple[np.ndarray, int]:
    """`values` (already weighted) as ring elements, and how many were clipped."""
    clipped = int(np.count_nonzero(np.abs(values) > CLIP_RANGE))
    fixed = np.rint(np.clip(values, -CLIP_RANGE, CLIP_RANGE) * SCALE).astype(np.int64)
    return fixed.astype(np.uint32), clipped


def dequantize(total: np.ndarray) -> np.ndarray:
    """A sum of quantized vectors (mod 2^32) back to float64: its two's-complement value."""
    return total.astype(np.uint32).view(np.int32).astype(np.float64) / SCALE


def quantization_bound(summands: int) -> float:
    """The largest error per entry of `dequantize(sum)` against the exact weighted sum of
    `summands` vectors within CLIP_RANGE: half a step each."""
    return summands / (2 * SCALE)


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def prg(seed: bytes, length: int) -> np.ndarray:
    """`length` ring elements expanded from a 32-byte key: ChaCha20's keystream."""
    stream = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(stream.update(b"\0" * (4 * length)), dtype="<u4").astype(np.uint32)


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _mask_key(seed: bytes) -> X25519PrivateKey:
    """The mask-agreement key pair a 16-byte seed stands for (its seed is what is shared)."""
    return X25519PrivateKey.from_private_bytes(_hkdf(seed, b"edgefl secagg mask key"))


@dataclass(frozen=True)
class Advert:
    """What a member advertises: its two public keys (raw X25519) and its weight."""

    cipher_key: bytes
    mask_key: bytes
    weight: int


def check_adverts(adverts: Mapping[str, Advert]) -> None:
    """SecAggError unless every advert holds two 32-byte keys and a positive weight."""
    for agent, advert in adverts.items():
        if len(advert.cipher_key) != 32 or len(advert.mask_key) != 32 or advert.weight <= 0:
            raise SecAggError(f"the secure-aggregation keys of {agent} are malformed")


def weights_of(adverts: Mapping[str, Advert]) -> dict[str, float]:
    """Each member's share a_u = w_u / W of U1's total weight."""
    total = sum(a.weight for a in adverts.values())
    return {k: a.weight / total for k, a in adverts.items()}


@dataclass(frozen=True)
class Context:
    """What binds a round's keys: its run and round (no mask or share is valid in another)."""

    run_id: str
    round: int

    def info(self, what: str) -> bytes:
        return f"edgefl secagg {what} {self.run_id} {self.round}".encode()


def _pairwise(context: Context, key: X25519PrivateKey, peer: bytes, length: int) -> np.ndarray:
    secret = key.exchange(X25519PublicKey.from_public_bytes(peer))
    return prg(_hkdf(secret, context.info("pairwise")), length)


def _self_mask(context: Context, seed: bytes, length: int) -> np.ndarray:
    return prg(_hkdf(seed, context.info("self")), length)


def _box(context: Context, key: X25519PrivateKey, peer: bytes) -> AESGCM:
    """The AES-GCM key two members share for the shares one sends the other."""
    return AESGCM(_hkdf(key.exchange(X25519PublicKey.from_public_bytes(peer)), context.info("box")))


def _indices(adverts: Mapping[str, Advert]) -> dict[str, int]:
    """Each member's Shamir x-coordinate: its place in sorted U1, from 1."""
    return {k: i + 1 for i, k in enumerate(sorted(adverts))}


def masking_sign(owner: str, peer: str) -> int:
    """+1 where `owner` adds the mask it shares with `peer`, -1 where it subtracts it."""
    return 1 if owner < peer else -1


@dataclass
class Client:
    """One member's side of a round. Its secrets never leave it but as encrypted shares."""

    me: str
    context: Context
    random: Callable[[int], bytes] = os.urandom
    adverts: dict[str, Advert] = field(default_factory=dict)
    """U1, as the key list the coordinator sent."""
    held: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    """U2: each sharer's shares held here (of b, of its mask-key seed)."""
    revealed: bool = False

    def __post_init__(self) -> None:
        self.cipher = X25519PrivateKey.generate()
        self.self_seed = self.random(_SEED_BYTES)
        self.mask_seed = self.random(_SEED_BYTES)
        self.mask = _mask_key(self.mask_seed)

    def advert(self, weight: int) -> Advert:
        return Advert(_raw(self.cipher.public_key()), _raw(self.mask.public_key()), weight)

    def shares(self, adverts: Mapping[str, Advert]) -> dict[str, bytes]:
        """The key list U1 arrived: each member's encrypted pair of shares (itself too)."""
        check_adverts(adverts)
        if self.me not in adverts:
            raise SecAggError(f"the key list leaves out {self.me}")
        mine = self.advert(adverts[self.me].weight)
        if (mine.cipher_key, mine.mask_key) != (
            adverts[self.me].cipher_key,
            adverts[self.me].mask_key,
        ):
            raise SecAggError("the key list holds other keys of this member (it restarted?)")
        self.adverts = dict(adverts)
        n, shamir = len(adverts), _shamir()
        t = threshold(n)
        of_b = dict(shamir.split(t, n, self.self_seed))
        of_s = dict(shamir.split(t, n, self.mask_seed))
        out = {}
        for agent, index in _indices(adverts).items():
            plain = index.to_bytes(_SEED_BYTES, "big") + of_b[index] + of_s[index]
            nonce = self.random(_NONCE_BYTES)
            box = _box(self.context, self.cipher, adverts[agent].cipher_key)
            out[agent] = nonce + box.encrypt(nonce, plain, f"{self.me}>{agent}".encode())
        return out

    def receive_shares(self, sealed: Mapping[str, bytes]) -> None:
        """The shares U2 sent this member, as the coordinator relayed them."""
        mine = _indices(self.adverts)[self.me]
        for sender, data in sealed.items():
            if sender not in self.adverts:
                raise SecAggError(f"shares from {sender}, who is not in the key list")
            box = _box(self.context, self.cipher, self.adverts[sender].cipher_key)
            try:
                plain = box.decrypt(
                    data[:_NONCE_BYTES], data[_NONCE_BYTES:], f"{sender}>{self.me}".encode()
                )
            except InvalidTag:
                raise SecAggError(f"the shares from {sender} do not decrypt") from None
            if len(plain) != _SHARE_PLAINTEXT or int.from_bytes(plain[:16], "big") != mine:
                raise SecAggError(f"the shares from {sender} are not this member's")
            self.held[sender] = (plain[16:32], plain[32:48])
        if self.me not in self.held:
            raise SecAggError("the relayed shares leave out this member's own")
        if len(self.held) < threshold(len(self.adverts)):
            raise SecAggError("too few members shared their keys to go on")

    def masked(self, values: np.ndarray) -> tuple[np.ndarray, int]:
        """This member's vector weighted, quantized and masked; and how many entries were
        clipped."""
        a = weights_of(self.adverts)[self.me]
        y, clipped = quantize(np.asarray(values, dtype=np.float64) * a)
        y = y + _self_mask(self.context, self.self_seed, y.size)
        for peer in sorted(self.held):
            if peer == self.me:
                continue
            mask = _pairwise(self.context, self.mask, self.adverts[peer].mask_key, y.size)
            y = y + mask if masking_sign(self.me, peer) > 0 else y - mask
        return y, clipped

    def reveal(self, survivors: Sequence[str]) -> dict[str, bytes]:
        """The shares that unmask the sum of `survivors` (U3): of b for each survivor, of
        the mask-key seed for each sharer that did not upload; once per round."""
        u3 = set(survivors)
        if self.revealed or not u3 <= set(self.held) or self.me not in u3:
            raise SecAggError("the survivor list is not a subset of who shared, with this member")
        if len(u3) < threshold(len(self.adverts)):
            raise SecAggError("too few members uploaded to unmask the sum")
        self.revealed = True
        return {k: self.held[k][0 if k in u3 else 1] for k in sorted(self.held)}


@dataclass
class Server:
    """The coordinator's side: relays, then unmasks only the sum."""

    context: Context
    adverts: dict[str, Advert]
    sharers: list[str] = field(default_factory=list)
    """U2: who sent shares (`relay`)."""

    def __post_init__(self) -> None:
        check_adverts(self.adverts)
        if len(self.adverts) < MIN_MEMBERS:
            raise SecAggError(
                f"{len(self.adverts)} member(s) advertised keys; a secure sum needs {MIN_MEMBERS}"
            )
        self.threshold = threshold(len(self.adverts))

    def relay(self, sent: Mapping[str, Mapping[str, bytes]]) -> dict[str, dict[str, bytes]]:
        """What each member of U1 receives: the shares each sharer encrypted for it."""
        self.sharers = sorted(k for k, out in sent.items() if set(out) == set(self.adverts))
        if len(self.sharers) < self.threshold:
            raise SecAggError(
                f"{len(self.sharers)} members shared keys; the round needs {self.threshold}"
            )
        return {v: {u: sent[u][v] for u in self.sharers} for v in self.adverts}

    def unmask(
        self, masked: Mapping[str, np.ndarray], reveals: Mapping[str, Mapping[str, bytes]]
    ) -> tuple[np.ndarray, list[str]]:
        """sum_{U3} a_u x_u (dequantized) from the masked vectors of U3 and the survivors'
        reveals, and U3."""
        u3 = sorted(k for k in masked if k in self.sharers)
        dropped = sorted(set(self.sharers) - set(u3))
        holders = sorted(k for k in reveals if k in u3)[: self.threshold]
        if len(holders) < self.threshold:
            raise SecAggError(
                f"{len(holders)} members revealed shares; unmasking needs {self.threshold}"
            )
        length = masked[u3[0]].size
        total = np.zeros(length, dtype=np.uint32)
        for k in u3:
            total = total + masked[k].astype(np.uint32)
        for k in u3:
            total = total - _self_mask(self.context, self._secret(k, holders, reveals), length)
        for gone in dropped:
            key = _mask_key(self._secret(gone, holders, reveals))
            if _raw(key.public_key()) != self.adverts[gone].mask_key:
                raise SecAggError(f"the revealed shares of {gone} do not rebuild its key")
            for k in u3:
                mask = _pairwise(self.context, key, self.adverts[k].mask_key, length)
                total = total + mask if masking_sign(k, gone) < 0 else total - mask
        return dequantize(total), u3

    def _secret(self, owner: str, holders: list[str], reveals: Mapping[str, Mapping]) -> bytes:
        index = _indices(self.adverts)
        shares = []
        for holder in holders:
            share = reveals[holder].get(owner)
            if not isinstance(share, bytes) or len(share) != _SEED_BYTES:
                raise SecAggError(f"{holder} revealed no share of {owner}")
            shares.append((index[holder], share))
        return combine(shares)


@functools.lru_cache(maxsize=4)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[Any, ...]:
    """The Lagrange coefficients at 0 of the points `xs` in pycryptodome's GF(2^128)."""
    from Crypto.Protocol.SecretSharing import _Element

    points = [_Element(x) for x in xs]
    coefficients = []
    for j, x_j in enumerate(points):
        numerator, denominator = _Element(1), _Element(1)
        for m, x_m in enumerate(points):
            if m != j:
                numerator *= x_m
                denominator *= x_j + x_m
        coefficients.append(numerator * denominator.inverse())
    return tuple(coefficients)


def combine(shares: Sequence[tuple[int, bytes]]) -> bytes:
    """The secret of `shares` (x, y), as pycryptodome's `Shamir.combine` computes it, with
    the Lagrange coefficients of one set of holders computed once for every secret they
    rebuild: the coordinator rebuilds a secret per member with the same holders, and
    `Shamir.combine` spends O(t^2) field products on each (3.6 s a round at 50 members,
    32 s at 100, against 0.1 s and 0.4 s so). tests/test_secagg.py checks it against
    `Shamir.combine`, which stays the reference."""
    from Crypto.Protocol.SecretSharing import _Element

    xs = tuple(x for x, _ in shares)
    if len(set(xs)) != len(xs):
        raise SecAggError("two shares of one holder")
    total = _Element(0)
    for coefficient, (_, y) in zip(_lagrange_at_zero(xs), shares, strict=True):
        total += _Element(y) * coefficient
    return bytes(total.encode())


@dataclass(frozen=True)
class InProcessSum:
    """`sum_in_process`'s result: the weighted mean over U3, U3, and what was clipped."""

    mean: np.ndarray
    survivors: list[str]
    clipped: int
    uploads: dict[str, np.ndarray]
    """Each masked vector as the coordinator received it."""


def sum_in_process(
    context: Context,
    vectors: Mapping[str, np.ndarray],
    weights: Mapping[str, int],
    drop_after_shares: Sequence[str] = (),
    drop_after_upload: Sequence[str] = (),
) -> InProcessSum:
    """A whole round in one process, in the order the messages take over MQTT: the
    simulator's secure aggregation, and the tests' (members may drop after sharing their
    keys, or after uploading). The mean is sum_{U3} w_u x_u / sum_{U3} w_u."""
    clients = {k: Client(k, context) for k in sorted(vectors)}
    adverts = {k: c.advert(weights[k]) for k, c in clients.items()}
    server = Server(context, adverts)
    relayed = server.relay({k: c.shares(adverts) for k, c in clients.items()})
    for k, c in clients.items():
        c.receive_shares(relayed[k])
    uploads, clipped = {}, 0
    for k, c in clients.items():
        if k not in drop_after_shares:
            uploads[k], n = c.masked(vectors[k])
            clipped += n
    survivors = sorted(uploads)
    reveals = {
        k: c.reveal(survivors)
        for k, c in clients.items()
        if k in uploads and k not in drop_after_upload
    }
    total, u3 = server.unmask(uploads, reveals)
    return InProcessSum(survivor_mean(total, adverts, u3), u3, clipped, uploads)


def survivor_mean(
    total: np.ndarray, adverts: Mapping[str, Advert], u3: Sequence[str]
) -> np.ndarray:
    """sum_{U3} a_u x_u rescaled to the weighted mean over U3: the weights of U1 that
    dropped do not count."""
    a = weights_of(adverts)
    return total / sum(a[k] for k in u3)
