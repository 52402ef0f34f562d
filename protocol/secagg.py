"""Secure aggregation (SecAgg+, Bell et al. 2020, as Flower runs it): the coordinator learns
the sum of the participants' vectors and nothing of any one of them. Pure: no training, no
transport, no clock; a round's messages are moved by the runtime
(`agent.runtime.secure_rounds`, `coordinator.secure_sum`) or in one process
(`sum_in_process`, for `coordinator simulate` and the tests). It lives in `protocol` because
it is wire-level cryptography over integer vectors, beside `protocol.signing`.

Each member masks with, and shares its secrets among, only its neighbours N(u) in the
round's random k-regular graph (`protocol.secagg_graph`: derived from the round and U1 alike
by every member and the coordinator; complete, so all-to-all SecAgg (Bonawitz et al. 2017),
for fleets under about 40). A round among the roster U1 (every step's senders are the next
step's cohort):

    advertise  each client makes two X25519 key pairs: one to encrypt shares (c), one whose
               agreement seeds the pairwise masks (s, derived from a 16-byte seed); it
               advertises both public keys and its weight (sample count)
    share      it Shamir-splits its self-mask seed b and its mask-key seed among N(u) and
               itself (threshold t, `protocol.shamir`), and encrypts each pair of shares for
               its holder (AES-GCM under HKDF(X25519(c_u, c_v))): the coordinator that relays
               them cannot read them. U2: who shared with its whole neighbourhood.
    mask       y_u = q(a_u x_u) + PRG(b_u) + sum_{v in U2 n N(u), v > u} PRG(s_uv)
               - sum_{v in U2 n N(u), v < u} PRG(s_uv) (mod 2^32): the pairwise masks cancel
               in the sum, the self mask hides y_u even from whoever learns s_uv of a dropped
               peer. U3: who uploaded y.
    check      each survivor signs U3 and the round (Ed25519, under a key it advertised with
               the other two: the consistency check of Bonawitz et al. 2017, as SecAgg+
               keeps it); the coordinator forwards the signatures it collected (U4: who
               signed); a member goes on only if the signers are members of the U3 it was
               sent, at least t of them from its own neighbourhood and 70% of U1 in all
               (`quorum`), and the signatures it counts (t of its neighbours', then others'
               up to the quorum; no more) are valid on that U3.
    unmask     each survivor that checked reveals, for each neighbour in U3, its share of
               b, and for each neighbour in U2 - U3, its share of the mask-key seed (never
               both for one member: `Client.reveal` refuses), so the coordinator rebuilds
               each secret from t of its owner's neighbours, removes the self masks of U3
               and the dropped members' pairwise masks, and is left with sum_{U3} q(a_u x_u).

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from protocol import secagg_graph, shamir

RING_BITS = 32
"""Masked values are integers modulo 2^32: as many bytes on the wire as a float32."""
CLIP_RANGE = 8.0
"""Each weighted entry a_u x_u is clipped to [-CLIP_RANGE, CLIP_RANGE] before quantization."""
SCALE = 2**27
"""Fixed-point scale: CLIP_RANGE * SCALE = 2^30 leaves 2^30 for the rounding of up to 2^31
summands before the sum would wrap."""
MIN_MEMBERS = 2
"""The fewest members a sum is taken over: the sum of one member is its vector."""
DROPOUT = secagg_graph.DROPOUT
"""The share of U1 that may drop at any step while the round still completes (`threshold`)."""
_SEED_BYTES = 16
"""Shamir (`protocol.shamir`) shares 16-byte secrets: the self-mask seed and the mask-key seed."""
_NONCE_BYTES = 12
_SHARE_PLAINTEXT = 3 * _SEED_BYTES
"""A holder's index, then its share of b and its share of the mask-key seed (16 bytes each)."""


class SecAggError(ValueError):
    """A round that cannot go on: too few members left, or a malformed or forged message."""


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
    """What a member advertises: its two public keys (raw X25519), its weight, and the
    public key (raw Ed25519) of its signature on the survivor list: one key pair a round, in
    the same `Keys` message as the others, so a fleet's signature on that message binds it
    to the device as it binds the other two."""

    cipher_key: bytes
    mask_key: bytes
    weight: int
    sign_key: bytes


def check_adverts(adverts: Mapping[str, Advert]) -> None:
    """SecAggError unless every advert holds two 32-byte keys and a positive weight."""
    for agent, advert in adverts.items():
        keys = (advert.cipher_key, advert.mask_key, advert.sign_key)
        if any(len(key) != 32 for key in keys) or advert.weight <= 0:
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


def survivors_statement(context: Context, survivors: Iterable[str]) -> bytes:
    """What a member signs in the consistency check: the round and U3 (names hold no
    newline, `protocol.topics.check_name`)."""
    return context.info("survivors") + b"\0" + "\n".join(sorted(set(survivors))).encode()


def signed_by(advert: Advert, signature: bytes, statement: bytes) -> bool:
    """Whether `signature` is the advertiser's on `statement`."""
    try:
        Ed25519PublicKey.from_public_bytes(advert.sign_key).verify(signature, statement)
    except (InvalidSignature, ValueError):
        return False
    return True


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


def round_graph(context: Context, members: Iterable[str]) -> Mapping[str, tuple[str, ...]]:
    """Each member's closed neighbourhood in the round's SecAgg+ graph (`protocol.secagg_graph`),
    which every member derives alike from the round and the key list."""
    return _graph(context.info("graph"), tuple(sorted(members)))


@functools.lru_cache(maxsize=8)
def _graph(seed: bytes, members: tuple[str, ...]) -> Mapping[str, tuple[str, ...]]:
    """Built once a round in a process (the simulator's and the bench's members share it)."""
    return MappingProxyType(secagg_graph.neighbourhoods(seed, members))


def threshold(members: int) -> int:
    """Shares of a member's neighbourhood that rebuild its secrets, in a round of `members`."""
    return secagg_graph.degree_and_threshold(members)[1]


def quorum(members: int) -> int:
    """Signatures on one survivor list a member needs from the whole round to reveal: all-to-
    all's threshold, 70% of U1 (what any 30% dropping leaves). Honest members sign one list
    each, so two lists that both reach it need 2 quorum - n members signing both: 40% of the
    round. t of a member's neighbourhood alone is not enough: a coordinator that knows the
    graph's ring tells the half-ring on one side of a victim that it uploaded and the other
    half that it dropped, and every member then sees k/2 + 1 >= t signatures on its list
    among its neighbours (`tests/test_secagg.py`)."""
    return secagg_graph.complete_threshold(members)


@dataclass
class Client:
    """One member's side of a round. Its secrets never leave it but as encrypted shares."""

    me: str
    context: Context
    random: Callable[[int], bytes] = os.urandom
    adverts: dict[str, Advert] = field(default_factory=dict)
    """U1, as the key list the coordinator sent."""
    neighbours: tuple[str, ...] = ()
    """This member's closed neighbourhood in the round's graph: whom it shares and masks with."""
    held: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    """U2 among the neighbours: each sharer's shares held here (of b, of its mask-key seed)."""
    signed: tuple[str, ...] | None = None
    """The survivor list U3 this member signed (`consent`): the only one it reveals for."""
    revealed: bool = False

    def __post_init__(self) -> None:
        self.cipher = X25519PrivateKey.generate()
        self.signing = Ed25519PrivateKey.generate()
        self.self_seed = shamir.secret_seed(self.random)
        self.mask_seed = shamir.secret_seed(self.random)
        self.mask = _mask_key(self.mask_seed)
        self._boxes: dict[str, AESGCM] = {}

    def advert(self, weight: int) -> Advert:
        signing = self.signing.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return Advert(_raw(self.cipher.public_key()), _raw(self.mask.public_key()), weight, signing)

    def _box(self, peer: str) -> AESGCM:
        """The AES-GCM key shared with `peer`, agreed once for sending and receiving shares."""
        if peer not in self._boxes:
            self._boxes[peer] = _box(self.context, self.cipher, self.adverts[peer].cipher_key)
        return self._boxes[peer]

    def shares(self, adverts: Mapping[str, Advert]) -> dict[str, bytes]:
        """The key list U1 arrived: each neighbour's encrypted pair of shares (itself too)."""
        check_adverts(adverts)
        if self.me not in adverts:
            raise SecAggError(f"the key list leaves out {self.me}")
        if self.advert(adverts[self.me].weight) != adverts[self.me]:
            raise SecAggError("the key list holds other keys of this member (it restarted?)")
        self.adverts = dict(adverts)
        self.neighbours = round_graph(self.context, adverts)[self.me]
        index, t = _indices(adverts), threshold(len(adverts))
        xs = [index[v] for v in self.neighbours]
        of_b = shamir.split(self.self_seed, t, xs, self.random)
        of_s = shamir.split(self.mask_seed, t, xs, self.random)
        out = {}
        for agent in self.neighbours:
            x = index[agent]
            plain = x.to_bytes(_SEED_BYTES, "big") + of_b[x] + of_s[x]
            nonce = self.random(_NONCE_BYTES)
            sealed = self._box(agent).encrypt(nonce, plain, f"{self.me}>{agent}".encode())
            out[agent] = nonce + sealed
        return out

    def receive_shares(self, sealed: Mapping[str, bytes]) -> None:
        """The shares U2's neighbours sent this member, as the coordinator relayed them."""
        mine = _indices(self.adverts)[self.me]
        for sender, data in sealed.items():
            if sender not in self.neighbours:
                raise SecAggError(f"shares from {sender}, who is not a neighbour in the round")
            try:
                plain = self._box(sender).decrypt(
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
            raise SecAggError("too few neighbours shared their keys to go on")

    def masked(self, values: np.ndarray) -> tuple[np.ndarray, int]:
        """This member's vector weighted, quantized and masked; and how many entries were
        clipped."""
        a = weights_of(self.adverts)[self.me]
        y, clipped = quantize(np.asarray(values, dtype=np.float64) * a)
        y += _self_mask(self.context, self.self_seed, y.size)
        for peer in sorted(self.held):
            if peer == self.me:
                continue
            mask = _pairwise(self.context, self.mask, self.adverts[peer].mask_key, y.size)
            if masking_sign(self.me, peer) > 0:
                y += mask
            else:
                y -= mask
        return y, clipped

    def consent(self, survivors: Sequence[str]) -> bytes:
        """This member's signature on the survivor list U3, once a round: the consistency
        check's first half (`reveal` goes on only for this U3)."""
        u3 = set(survivors)
        if (
            self.signed is not None
            or self.me not in u3
            or not u3 <= set(self.adverts)
            or not u3 & set(self.neighbours) <= set(self.held)
        ):
            raise SecAggError("the survivor list is not a subset of who shared, with this member")
        if len(u3) < threshold(len(self.adverts)):
            raise SecAggError("too few members uploaded to unmask the sum")
        self.signed = tuple(sorted(u3))
        return self.signing.sign(survivors_statement(self.context, u3))

    def reveal(self, survivors: Sequence[str], signatures: Mapping[str, bytes]) -> dict[str, bytes]:
        """The shares that unmask the sum of `survivors` (U3): of b for each neighbour that
        survived, of the mask-key seed for each that shared and did not upload; once a
        round, so never both secrets of one member. Only for the U3 this member signed
        (`consent`), and only if the forwarded `signatures` (signer: signature) come from
        members of U3, at least t of them from this member's neighbourhood and a quorum of
        the round's in all (`quorum`), each checked valid on U3 (`_vouched`): so a
        coordinator that sent other survivor lists to some members gets no reveal from them."""
        if self.revealed or self.signed is None or tuple(sorted(set(survivors))) != self.signed:
            raise SecAggError("the survivor list is not the one this member signed")
        for signer in signatures:
            if signer not in self.signed:
                raise SecAggError(f"{signer} did not sign this survivor list: lists differ")
        vouched = len(set(signatures) & set(self.neighbours))
        t = threshold(len(self.adverts))
        if vouched < t:
            raise SecAggError(f"{vouched} neighbours signed the survivor list; revealing needs {t}")
        if len(signatures) < quorum(len(self.adverts)):
            raise SecAggError(
                f"{len(signatures)} members signed the survivor list; "
                f"revealing needs {quorum(len(self.adverts))}"
            )
        self._vouched(signatures, t)
        self.revealed = True
        u3 = set(self.signed)
        return {k: self.held[k][0 if k in u3 else 1] for k in sorted(self.held)}

    def _vouched(self, signatures: Mapping[str, bytes], t: int) -> None:
        """Check as many of `signatures` as revealing counts, t of the neighbours' first, then
        any up to the quorum; SecAggError at the first one that is not its signer's on U3.
        What reveal needs is a quorum of valid signatures on this U3, t of them from the
        neighbourhood; a signature beyond those is counted for nothing, so it is not
        checked: an Ed25519 verification is a device's largest cost of the round (about 60 us,
        one per survivor: 3 ms of 6 at 50 members)."""
        statement = survivors_statement(self.context, self.signed or ())
        neighbours = set(self.neighbours)
        order = sorted(signatures, key=lambda s: s not in neighbours)  # neighbours first
        needed, near_needed = quorum(len(self.adverts)), t
        for signer in order:
            if needed <= 0 and near_needed <= 0:
                return
            if not signed_by(self.adverts[signer], signatures[signer], statement):
                raise SecAggError(f"{signer} did not sign this survivor list: lists differ")
            needed -= 1
            near_needed -= signer in neighbours


@dataclass
class Server:
    """The coordinator's side: relays, then unmasks only the sum."""

    context: Context
    adverts: dict[str, Advert]
    sharers: list[str] = field(default_factory=list)
    """U2: who sent shares to its whole neighbourhood (`relay`)."""

    def __post_init__(self) -> None:
        check_adverts(self.adverts)
        if len(self.adverts) < MIN_MEMBERS:
            raise SecAggError(
                f"{len(self.adverts)} member(s) advertised keys; a secure sum needs {MIN_MEMBERS}"
            )
        self.threshold = threshold(len(self.adverts))
        self.graph = round_graph(self.context, self.adverts)

    def relay(self, sent: Mapping[str, Mapping[str, bytes]]) -> dict[str, dict[str, bytes]]:
        """What each member of U1 receives: the shares each sharer among its neighbours
        encrypted for it."""
        self.sharers = sorted(k for k, out in sent.items() if set(out) == set(self.graph[k]))
        if len(self.sharers) < self.threshold:
            raise SecAggError(
                f"{len(self.sharers)} members shared keys; the round needs {self.threshold}"
            )
        shared = set(self.sharers)
        return {v: {u: sent[u][v] for u in self.graph[v] if u in shared} for v in self.adverts}

    def unmask(
        self, masked: Mapping[str, np.ndarray], reveals: Mapping[str, Mapping[str, bytes]]
    ) -> tuple[np.ndarray, list[str]]:
        """sum_{U3} a_u x_u (dequantized) from the masked vectors of U3 and the survivors'
        reveals, and U3."""
        u3 = sorted(k for k in masked if k in self.sharers)
        if len(u3) < self.threshold:
            raise SecAggError(f"{len(u3)} members uploaded; unmasking needs {self.threshold}")
        dropped = sorted(set(self.sharers) - set(u3))
        revealers = {k for k in reveals if k in u3}
        length = masked[u3[0]].size
        total = np.zeros(length, dtype=np.uint32)
        for k in u3:
            total += masked[k].astype(np.uint32)
            total -= _self_mask(self.context, self._secret(k, revealers, reveals), length)
        for gone in dropped:
            key = _mask_key(self._secret(gone, revealers, reveals))
            if _raw(key.public_key()) != self.adverts[gone].mask_key:
                raise SecAggError(f"the revealed shares of {gone} do not rebuild its key")
            survivors = set(u3)
            for k in self.graph[gone]:
                if k in survivors:
                    mask = _pairwise(self.context, key, self.adverts[k].mask_key, length)
                    if masking_sign(k, gone) < 0:
                        total += mask
                    else:
                        total -= mask
        return dequantize(total), u3

    def _secret(self, owner: str, revealers: set[str], reveals: Mapping[str, Mapping]) -> bytes:
        """`owner`'s secret from the shares of the first t of its neighbours that revealed."""
        holders = [h for h in self.graph[owner] if h in revealers][: self.threshold]
        if len(holders) < self.threshold:
            raise SecAggError(
                f"{len(holders)} neighbours of {owner} revealed shares; it needs {self.threshold}"
            )
        index = _indices(self.adverts)
        shares = []
        for holder in holders:
            share = reveals[holder].get(owner)
            if not isinstance(share, bytes) or len(share) != _SEED_BYTES:
                raise SecAggError(f"{holder} revealed no share of {owner}")
            shares.append((index[holder], share))
        try:
            return shamir.combine(shares)
        except shamir.ShamirError as exc:
            raise SecAggError(f"the shares of {owner}: {exc}") from None


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
    keys, or after uploading: then before the consistency check). The mean is
    sum_{U3} w_u x_u / sum_{U3} w_u."""
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
    staying = [k for k in survivors if k not in drop_after_upload]
    signatures = {k: clients[k].consent(survivors) for k in staying}
    reveals = {k: clients[k].reveal(survivors, signatures) for k in staying}
    total, u3 = server.unmask(uploads, reveals)
    return InProcessSum(survivor_mean(total, adverts, u3), u3, clipped, uploads)


def survivor_mean(
    total: np.ndarray, adverts: Mapping[str, Advert], u3: Sequence[str]
) -> np.ndarray:
    """sum_{U3} a_u x_u rescaled to the weighted mean over U3: the weights of U1 that
    dropped do not count."""
    a = weights_of(adverts)
    return total / sum(a[k] for k in u3)
