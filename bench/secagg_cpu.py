"""Where a secure round's CPU goes (issue 48): CPU-seconds of a steady round of an emulated
FedAvg fleet by process kind, plain against `--secure-aggregation`, and the round's MQTT
messages by kind.

    python -m bench.secagg_cpu [--agents 50] [--rounds 6] [--seeds 1,2]
        [--broker embedded|mosquitto|HOST:PORT] [--py-spy FOLDER] [--out FILE.json]

bench.secagg's CPU figure is the difference of two whole runs' CPU over their difference of
rounds: start-up (the agents' interpreters, torch, the dataset) does not cancel exactly, and
a few rounds' difference drowns in it (it gave negative CPU a round). Here one run of
`--rounds` is watched as it goes: every 0.1 s the CPU of each agent process, of the embedded
broker's thread and of the rest of this process (the coordinator; the watch's own thread left
out) is sampled, and a steady round's CPU is what each kind spent between the end of round 2
and the end of the last round (the last agent's, from the round logs), over the rounds
between. Per seed, plain and secure run interleaved (mnist1d, Dirichlet 0.5, FedAvg under
`--aggregation mean`, agents sharing processes as `coordinator emulate` spreads them).

A second pair of runs (one a mode) counts the messages: a subscriber to the whole fleet
(which the broker then delivers everything to once more, so their CPU is not taken) tallies
each round's publications by kind and sender (an agent, or the coordinator) and their
bytes; `deliveries` is what the broker sent on to the fleet (a coordinator's message to
every agent for a broadcast kind, to one for the others).

`--py-spy FOLDER` records each process of the first seed's runs with py-spy (a dev tool, not
a dependency: `pip install py-spy`), under FOLDER/plain and FOLDER/secure: collapsed stacks
(`--format raw`, for flamegraph.pl or speedscope), one file a process, every thread, idle
waits included (with `--gil` py-spy left out nearly all of OpenSSL's
Ed25519 verifications here, the round's largest cost at a device).

The first table is the cryptography and messages of one round in this process
(`step_costs`): each step's CPU-seconds for the whole fleet of devices and for the
coordinator, every message encoded and decoded as on the wire (an unsigned fleet, as the
emulated runs); what the emulated secure round costs beyond it is the transport's: the
broker's deliveries, paho's reading and writing, the threads that wait and wake.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from bench.secagg import config, masked_length
from bench.support import broker, environment, fleet_round_ends, seeds, write_json
from coordinator.emulate import Emulation, EmulationOptions, auto_agents_per_process
from protocol import MqttTransport, TransportOptions, messages, secagg, topics

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("agents", "broker", "coordinator")
BROADCASTS = frozenset({"keylist", "survivors", "consent", "support", "global", "run", "tally"})
"""Kinds the coordinator publishes to every agent (`deliveries`)."""


class CpuWatch(threading.Thread):
    """CPU-seconds so far of the agents' processes, the broker's thread and the rest of this
    process, sampled every `period_s` with the time."""

    def __init__(self, emulation: Emulation, period_s: float = 0.1) -> None:
        super().__init__(daemon=True, name="cpu-watch")
        self.emulation, self.period_s = emulation, period_s
        self.done = threading.Event()
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.last: dict[int, float] = {}
        """Each agent process's CPU when last seen (a process that ended keeps it)."""

    def run(self) -> None:
        me = psutil.Process()
        handles: dict[int, psutil.Process] = {}
        while not self.done.wait(self.period_s):
            names = {t.native_id: t.name for t in threading.enumerate()}
            threads = {t.id: t.user_time + t.system_time for t in me.threads()}
            broker = sum(c for i, c in threads.items() if names.get(i, "").startswith("amqtt"))
            watch = threads.get(threading.get_native_id(), 0.0)
            own = sum(me.cpu_times()[:2])
            for pid in {p.pid for p in list(self.emulation.processes.values())}:
                try:
                    handle = handles.setdefault(pid, psutil.Process(pid))
                    self.last[pid] = sum(handle.cpu_times()[:2])
                except psutil.Error:
                    continue
            agents = sum(self.last.values())
            sample = {"agents": agents, "broker": broker, "coordinator": own - broker - watch}
            self.samples.append((time.time(), sample))

    def at(self, when: float) -> dict[str, float]:
        """Each kind's CPU at `when`, interpolated between samples."""
        times = [t for t, _ in self.samples]
        return {k: float(np.interp(when, times, [s[k] for _, s in self.samples])) for k in KINDS}


class MessageCount:
    """Every fleet message a round, by kind and by who sent it (an agent or the coordinator)."""

    def __init__(self, emulation: Emulation, address: Any) -> None:
        self.counts: collections.Counter[tuple[int, str, str]] = collections.Counter()
        self.sizes: collections.Counter[tuple[int, str, str]] = collections.Counter()
        self.spy = MqttTransport(address, TransportOptions(client_id="secagg-cpu-count"))
        self.spy.subscribe(f"{topics.fleet_root(emulation.fleet)}/#", self.on_message)
        self.spy.start()
        if not self.spy.wait_subscribed(20.0):
            raise RuntimeError("the counting subscriber could not subscribe")

    def on_message(self, topic: str, payload: bytes) -> None:
        parts = topic.split("/")
        if len(parts) < 6 or parts[3] != "round":
            return
        kind, sender = parts[5], parts[6] if len(parts) > 6 else "coordinator"
        who = "coordinator" if sender.startswith("coordinator") else "agent"
        key = (int(parts[4]), kind, who)
        self.counts[key] += 1
        self.sizes[key] += len(payload)


@contextlib.contextmanager
def fleet(
    agents: int, seed: int, rounds: int, secure: bool, spec: str
) -> Iterator[tuple[Emulation, Any, pathlib.Path]]:
    """A run's emulation, not started yet, on a broker of its own, with the broker's address
    and the agents' folder (removed on leaving)."""
    cfg = config(agents, seed, rounds, secure)
    with tempfile.TemporaryDirectory(prefix="secagg-cpu-") as folder:
        workdir = pathlib.Path(folder)
        with broker(spec, workdir) as address:
            options = EmulationOptions(
                workdir=workdir / "fleet", agents_per_process=auto_agents_per_process(agents)
            )
            yield Emulation(cfg, address, options), address, workdir / "fleet"


def emulate(
    agents: int, seed: int, rounds: int, secure: bool, spec: str, spy: pathlib.Path | None = None
) -> dict[str, Any]:
    """One run, watched: each kind's CPU a steady round (rounds 3 to the last)."""
    with fleet(agents, seed, rounds, secure, spec) as (emulation, _, agents_folder):
        watch = CpuWatch(emulation)
        spies = PySpy(emulation, spy) if spy is not None else None
        watch.start()
        try:
            emulation.run()
        finally:
            watch.done.set()
            watch.join()
            if spies is not None:
                spies.stop()
        ends = fleet_round_ends(agents_folder, emulation.roster)
    first, last = watch.at(ends[2]), watch.at(ends[rounds])
    per_round = {k: (last[k] - first[k]) / (rounds - 2) for k in KINDS}
    return {
        "cpu_per_round_s": per_round,
        "round_s": (ends[rounds] - ends[2]) / (rounds - 2),
    }


def count(agents: int, seed: int, rounds: int, secure: bool, spec: str) -> dict[str, Any]:
    """One run's messages a steady round (rounds 3 to the last), by kind and sender."""
    with fleet(agents, seed, rounds, secure, spec) as (emulation, address, _):
        counter = MessageCount(emulation, address)
        try:
            emulation.run()
        finally:
            counter.spy.stop()
    steady = range(3, rounds + 1)
    out: dict[str, dict[str, float]] = {}
    for (round_, kind, who), n in counter.counts.items():
        if round_ in steady:
            row = out.setdefault(f"{kind} ({who})", {"messages": 0.0, "bytes": 0.0})
            row["messages"] += n / len(steady)
            row["bytes"] += counter.sizes[(round_, kind, who)] / len(steady)
            fanout = agents if who == "coordinator" and kind in BROADCASTS else 1
            row["deliveries"] = row["messages"] * fanout
    return out


class PySpy:
    """py-spy recording each agent process once it starts, and this process."""

    def __init__(self, emulation: Emulation, folder: pathlib.Path) -> None:
        binary = shutil.which("py-spy")
        if binary is None:
            raise SystemExit("--py-spy needs py-spy on the PATH: pip install py-spy")
        folder.mkdir(parents=True, exist_ok=True)
        self.binary, self.folder, self.emulation = binary, folder, emulation
        self.recorders: list[subprocess.Popen[bytes]] = []
        self.done = threading.Event()
        self.record(os.getpid(), "coordinator")
        threading.Thread(target=self.follow, daemon=True).start()

    def record(self, pid: int, name: str) -> None:
        out = self.folder / f"{name}.txt"
        command = [self.binary, "record", "--pid", str(pid), "--format", "raw", "--rate", "50",
                   "--nonblocking", "--threads", "-o", str(out)]  # fmt: skip
        self.recorders.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))

    def follow(self) -> None:
        seen: set[int] = set()
        while not self.done.wait(0.2):
            for pid in {p.pid for p in list(self.emulation.processes.values())} - seen:
                seen.add(pid)
                self.record(pid, f"agents-{pid}")

    def stop(self) -> None:
        self.done.set()
        for recorder in self.recorders:
            recorder.send_signal(2)
        for recorder in self.recorders:
            recorder.wait(30)


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(title="CPU-seconds a steady round by process kind (one row a seed)")
    for header in ("agents", "seed", "mode", "round s", *KINDS, "total"):
        out.add_column(header, justify="right")
    for row in rows:
        for mode in ("plain", "secure"):
            cpu = row[mode]["cpu_per_round_s"]
            out.add_row(str(row["agents"]), str(row["seed"]), mode,
                        f"{row[mode]['round_s']:.2f}", *(f"{cpu[k]:.2f}" for k in KINDS),
                        f"{sum(cpu.values()):.2f}")  # fmt: skip
    return out


def message_table(counts: dict[str, dict[str, dict[str, float]]]) -> Table:
    out = Table(title="Messages a steady round, by kind and sender (deliveries: to the fleet)")
    figures = ("messages", "deliveries", "bytes")
    for header in ("kind", *(f"{m} {f}" for m in ("plain", "secure") for f in figures)):
        out.add_column(header, justify="right")
    empty = dict.fromkeys(figures, 0.0)
    for kind in sorted(set(counts["plain"]) | set(counts["secure"])):
        rows = [counts[m].get(kind, empty) for m in ("plain", "secure")]
        out.add_row(kind, *(f"{r[f]:,.0f}" for r in rows for f in figures))
    return out


def step_table(steps: dict[str, float], members: int, length: int) -> Table:
    out = Table(title=f"A secure round's steps in one process ({members} devices, {length} values)")
    out.add_column("step: who")
    out.add_column("CPU s a round", justify="right")
    for step, seconds in steps.items():
        out.add_row(step, f"{seconds:.3f}")
    out.add_row("total", f"{sum(steps.values()):.3f}")
    return out


def step_costs(members: int, length: int, repeats: int = 3) -> dict[str, float]:
    """CPU-seconds of each step of a round in one process, the fleet's (all `members` devices
    together) and the coordinator's, messages encoded and decoded as on the wire (unsigned
    fleet); the least of `repeats` rounds."""
    best: dict[str, float] = {}
    for repeat in range(repeats):
        for step, seconds in one_round(members, length, repeat).items():
            best[step] = min(best.get(step, math.inf), seconds)
    return best


def one_round(members: int, length: int, seed: int) -> dict[str, float]:
    """One secure round in this process (`step_costs`): each step's CPU-seconds."""
    costs: collections.Counter[str] = collections.Counter()
    names = [f"agent-{i:03d}" for i in range(members)]
    context = secagg.Context("run-bench", 1)
    rng = np.random.default_rng(seed)

    def header(sender: str) -> dict[str, Any]:
        return {"fleet": "bench", "sender": sender, "run_id": "run-bench", "round": 1}

    @contextlib.contextmanager
    def step(name: str) -> Iterator[None]:
        started = time.process_time()
        yield
        costs[name] += time.process_time() - started

    with step("keys: devices"):
        clients = {k: secagg.Client(k, context) for k in names}
        keys = {
            k: messages.encode(messages.Keys(**header(k), **keys_body(c)))
            for k, c in clients.items()
        }
    with step("key list: coordinator"):
        adverts = {k: advert_of(messages.decode(data)) for k, data in keys.items()}
        server = secagg.Server(context, adverts)
        listed = messages.encode(
            messages.KeyList(**header("coordinator"), keys=list(keys.values()))
        )
    with step("key list and shares: devices"):
        sent = {}
        for k, c in clients.items():
            inner = messages.decode(listed).keys  # type: ignore[attr-defined]
            sealed = c.shares({m.sender: advert_of(m) for m in map(messages.decode, inner)})
            body = messages.Shares(
                **header(k), target="coordinator", peers=list(sealed), sealed=list(sealed.values())
            )
            sent[k] = messages.encode(body)
    with step("shares relayed: coordinator"):
        got = {k: messages.decode(data) for k, data in sent.items()}
        relayed = server.relay(
            {k: dict(zip(m.peers, m.sealed, strict=True)) for k, m in got.items()}
        )  # type: ignore[attr-defined]
        out = {
            k: messages.encode(
                messages.Shares(
                    **header("coordinator"), target=k, peers=list(s), sealed=list(s.values())
                )
            )
            for k, s in relayed.items()
        }
    with step("relayed shares and masking: devices"):
        uploads = {}
        for k, c in clients.items():
            shares = messages.decode(out[k])
            c.receive_shares(dict(zip(shares.peers, shares.sealed, strict=True)))  # type: ignore[attr-defined]
            y, _ = c.masked(rng.normal(0, 0.01, length))
            uploads[k] = messages.encode(
                messages.Masked(**header(k), values=y.astype("<u4").tobytes())
            )
    with step("survivors: coordinator"):
        masked = {
            k: np.frombuffer(messages.decode(d).values, dtype="<u4").astype(np.uint32)
            for k, d in uploads.items()
        }  # type: ignore[attr-defined]
        survivors = messages.encode(
            messages.Survivors(**header("coordinator"), survivors=sorted(masked))
        )
    with step("consent: devices"):
        signed = {}
        for k, c in clients.items():
            u3 = messages.decode(survivors).survivors  # type: ignore[attr-defined]
            signed[k] = messages.encode(
                messages.Consent(**header(k), signers=[k], signatures=[c.consent(u3)])
            )
    with step("consent forward: coordinator"):
        own = {k: messages.decode(d).signatures[0] for k, d in signed.items()}  # type: ignore[attr-defined]
        forward = messages.encode(
            messages.Consent(
                **header("coordinator"), signers=list(own), signatures=list(own.values())
            )
        )
    with step("reveal: devices"):
        reveals = {}
        for k, c in clients.items():
            f = messages.decode(forward)
            shares = c.reveal(sorted(masked), dict(zip(f.signers, f.signatures, strict=True)))  # type: ignore[attr-defined]
            reveals[k] = messages.encode(
                messages.Reveal(**header(k), owners=list(shares), shares=list(shares.values()))
            )
    with step("unmask: coordinator"):
        opened = {k: messages.decode(d) for k, d in reveals.items()}
        server.unmask(
            masked, {k: dict(zip(m.owners, m.shares, strict=True)) for k, m in opened.items()}
        )  # type: ignore[attr-defined]
    return dict(costs)


def keys_body(client: secagg.Client) -> dict[str, Any]:
    advert = client.advert(100)
    return {
        "cipher_key": advert.cipher_key,
        "mask_key": advert.mask_key,
        "num_samples": 100,
        "sign_key": advert.sign_key,
    }


def advert_of(keys: Any) -> secagg.Advert:
    return secagg.Advert(keys.cipher_key, keys.mask_key, keys.num_samples, keys.sign_key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seeds", type=seeds, default=[1, 2])
    parser.add_argument("--broker", default="embedded", help="embedded, mosquitto or HOST:PORT")
    parser.add_argument("--no-count", action="store_true", help="skip the counting runs")
    parser.add_argument("--py-spy", type=pathlib.Path, help="record the first secure run here")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/secagg_cpu.json")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error("--rounds must be at least 4 (rounds 1 and 2 hold the start-up)")
    given = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    record: dict[str, Any] = {"environment": environment(), "args": given}
    length = masked_length(config(2, 1, 1, True))
    record["steps"] = step_costs(args.agents, length)
    Console(width=160).print(step_table(record["steps"], args.agents, length))
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        row: dict[str, Any] = {"agents": args.agents, "seed": seed, "loadavg": os.getloadavg()}
        for mode in ("plain", "secure"):
            spy = args.py_spy / mode if args.py_spy and seed == args.seeds[0] else None
            row[mode] = emulate(args.agents, seed, args.rounds, mode == "secure", args.broker, spy)
        rows.append(row)
        Console(width=160).print(table(rows))
    record["rows"] = rows
    if not args.no_count:
        seed = args.seeds[0]
        counts = {m: count(args.agents, seed, 4, m == "secure", args.broker)
                  for m in ("plain", "secure")}  # fmt: skip
        Console(width=160).print(message_table(counts))
        record["messages"] = counts
    write_json(args.out, record)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
