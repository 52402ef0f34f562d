"""Hostile flood: an emulated fleet runs while a client on the broker publishes thousands of
hostile payloads on the fleet's topics; the run must give the numbers of `simulate`, and each
agent's memory must stay within a bound of its memory in the same run without the flood.

    python -m bench.flood [--payloads 5000] [--agents 4] [--rounds 4] [--wire delta]
        [--broker mosquitto|embedded|HOST:PORT] [--out bench/results/flood.json]

The payloads, in equal turns (`KINDS`): random bytes; truncated frames; first chunks that
declare 512 MiB (dropped on their header); first chunks that declare just under the message
limit and never finish (buffered, then evicted); forged whole models and deltas of rounds far
ahead; forged models of the run's rounds claiming 10^15 samples; forged requests for the
agents' models. Each agent's peak resident memory is its VmHWM (/proc/PID/status, sampled
every 50 ms until it exits).

The bound, per agent: peak with the flood <= peak without + 2 x max_partial_bytes (partial
reassembly and the delivery queue, `protocol.limits.limits_for_shapes` of the run's model)
+ SLACK_MB (allocator), whatever the number of payloads. Memory the flood could claim beyond
that (future rounds, requests) is dropped unread.

Measured (mosquitto, 4 agents x 6 rounds, mnist1d, dadpfl, --wire delta, 5,000 payloads
sent in about 4 s from the first agent's ready status; 2 shared cores; peak RSS in MiB,
growth over the clean run in brackets):

    limits: messages <= 1.05 MiB, partial reassembly and delivery queue <= 4.20 MiB each;
    bound on growth 24.4 MiB
    agent        clean     flooded         flooded, default limits (run limits undone)
    agent-000    298.0     304.0 (+6.0)    348.7 (+50.8)
    agent-001    297.8     304.1 (+6.3)    348.8 (+51.0)
    agent-002    297.8     304.8 (+7.0)    348.8 (+51.1)
    agent-003    297.8     303.8 (+6.0)    349.0 (+51.3)
    all three runs equal to simulate; rounds 1..4 (1..3) of 6 ended during the flood

The default-limits run shows what `set_limits` buys: the default limits bound partial
reassembly only by `max_partials` (256) x the flood's 256 KiB chunks.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import pathlib
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime import expected_shapes, model_message
from agent.workload import build_workload
from bench.support import fleet_round_ends
from coordinator.emulate import Emulation, EmulationOptions
from protocol import BrokerAddress, messages, topics
from protocol.chunking import MAGIC, split
from protocol.limits import Limits, run_limits

ROOT = pathlib.Path(__file__).resolve().parents[1]

MB = 2**20
SLACK_MB = 16.0
RUNS = (("clean", 0, False), ("flooded", 1, False), ("flooded, default limits", 1, True))
"""Name, whether flooded, whether the agents keep the default limits."""
KINDS = ("random", "truncated", "huge", "near_limit", "future", "samples", "requests")
NO_LIMITS = "EDGEFL_FLOOD_DEFAULT_LIMITS"
"""Set in an agent's environment: it keeps the default limits (the comparison run)."""
FAR_AHEAD = 50
"""Forged future rounds start this far past the run's last round."""


# ------------------------------------------------------------------------ the agents' limits


def agent_main() -> None:
    """`python -m bench.flood agent ARGS`: `edge-agent ARGS`; with NO_LIMITS set, the
    session's run limits are put back to the defaults (the comparison run: what the run's
    limits buy)."""
    from agent.cli import main
    from agent.runtime import session as session_module
    from protocol.limits import DEFAULT_LIMITS

    original = session_module.Session.__init__

    def init(self: Any, **options: Any) -> None:
        original(self, **options)
        if os.environ.get(NO_LIMITS):
            self.transport.set_limits(DEFAULT_LIMITS)
            self.inbox.limits = DEFAULT_LIMITS

    session_module.Session.__init__ = init  # type: ignore[method-assign]
    main(args=sys.argv[2:], prog_name="edge-agent")


class LimitedEmulation(Emulation):
    """An emulation whose agents run through `agent_main` (for the default-limits run)."""

    def agent_command(self, index: int) -> list[str]:
        module, *args = super().agent_command(index)
        assert module == "agent", module
        return ["bench.flood", "agent", *args]


# ------------------------------------------------------------------------ hostile payloads


@dataclasses.dataclass
class Target:
    """What the flooder knows of the run: what anyone on the broker can read off it."""

    fleet: str
    run_id: str
    roster: list[str]
    rounds: int
    weights: dict[str, Any]
    limits: Limits


def first_chunk(total: int, chunk_size: int) -> bytes:
    """The first chunk of a message declaring `total` bytes, of which only it ever comes."""
    count = -(-total // chunk_size)
    digest = hashlib.sha256(os.urandom(8)).digest()
    header = [MAGIC, 1, os.urandom(16), 0, count, chunk_size, total, digest]
    return msgpack.packb(header) + os.urandom(chunk_size)


def forged_model(target: Target, sender: str, round_: int, **fields: Any) -> bytes:
    options = {"num_samples": 100, **fields}
    return model_message(
        fleet=target.fleet,
        sender=sender,
        run_id=target.run_id,
        round_=round_,
        weights=target.weights,
        masks=None,
        **options,
    )


def payload(kind: str, target: Target, rng: random.Random) -> tuple[str, bytes]:
    """One hostile (topic, payload) of `kind`."""
    sender, victim = rng.sample(target.roster, 2)
    round_ = rng.randint(1, target.rounds)
    model_topic = topics.round_topic(target.fleet, round_, "model", sender)
    if kind == "random":
        kinds = ("model", "vote", "divergence")
        topic = topics.round_topic(target.fleet, round_, rng.choice(kinds), sender)
        return topic, os.urandom(rng.randint(1, 4096))
    if kind == "truncated":
        frames = split(forged_model(target, sender, round_), 64 * 1024)
        frame = rng.choice(frames)
        return model_topic, frame[: rng.randint(1, len(frame) - 1)]
    if kind == "huge":
        return model_topic, first_chunk(512 * MB, 64 * 1024)
    if kind == "near_limit":
        far = topics.round_topic(target.fleet, rng.randint(1, 10**6), "model", sender)
        return far, first_chunk(target.limits.max_message_bytes - 1, 256 * 1024)
    if kind == "future":
        far_round = target.rounds + FAR_AHEAD + rng.randint(0, 10**6)
        base = far_round - 1 if rng.random() < 0.5 else -1
        topic = topics.round_topic(target.fleet, far_round, "model", sender)
        return topic, forged_model(target, sender, far_round, base_round=base)
    if kind == "samples":
        return model_topic, forged_model(target, sender, round_, num_samples=10**15)
    request = messages.Request(
        fleet=target.fleet, sender=sender, run_id=target.run_id, round=round_, target=victim
    )
    topic = topics.round_topic(target.fleet, round_, "request", sender, to=victim)
    return topic, messages.encode(request)


def hostile(target: Target, count: int, seed: int = 0) -> Iterator[tuple[str, str, bytes]]:
    """`count` hostile (kind, topic, payload)s, the kinds in turn."""
    rng = random.Random(seed)
    for n in range(count):
        kind = KINDS[n % len(KINDS)]
        yield (kind, *payload(kind, target, rng))


def flood(
    broker: BrokerAddress, fleet: str, items: Iterator[tuple[str, str, bytes]]
) -> dict[str, Any]:
    """Once an agent of `fleet` says it is ready (its session and limits are in place),
    publish every item (QoS 1, never retained) from a client of its own; the count per kind
    and how long it took."""
    ready = threading.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"hostile-{os.getpid()}")
    client.max_inflight_messages_set(200)
    client.on_message = lambda *args: ready.set()
    client.connect(broker.host, broker.port)
    client.subscribe(topics.status(fleet), qos=0)
    client.loop_start()
    sent: dict[str, Any] = {}
    try:
        if not ready.wait(120):
            return sent
        started = time.monotonic()
        sent["started_at"] = time.time()
        last = None
        for kind, topic, data in items:
            last = client.publish(topic, data, qos=1)
            sent[kind] = sent.get(kind, 0) + 1
        if last is not None:
            last.wait_for_publish(120)
        sent["seconds"] = round(time.monotonic() - started, 1)
        sent["ended_at"] = time.time()
    finally:
        client.disconnect()
        client.loop_stop()
    return sent


# ------------------------------------------------------------------------ measuring


class PeakSampler(threading.Thread):
    """Each agent process's VmHWM (peak resident memory), every `period_s`, until it exits."""

    def __init__(self, emulation: Emulation, period_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.emulation, self.period_s = emulation, period_s
        self.peaks: dict[str, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for agent_id, popen in list(self.emulation.processes.items()):
                peak = vm_hwm(popen.pid)
                if peak is not None:
                    self.peaks[agent_id] = max(peak, self.peaks.get(agent_id, 0))
            time.sleep(self.period_s)


def vm_hwm(pid: int) -> int | None:
    """Peak resident bytes of a live process, None once it is gone."""
    try:
        text = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def run_fleet(
    config: ExperimentConfig,
    broker: BrokerAddress,
    workdir: pathlib.Path,
    payloads: int,
    *,
    default_limits: bool = False,
) -> dict[str, Any]:
    """One emulated run, flooded with `payloads` hostile payloads once an agent is ready
    (with `default_limits` its agents keep the default limits); returns its report, the
    agents' peaks, what was sent (and when), the rounds' ends and the limits."""
    emulation = LimitedEmulation(config, broker, EmulationOptions(workdir=workdir, linger_s=20.0))
    workload = build_workload(config, emulation.roster, agents=emulation.roster[:1])
    weights = workload.learner.facts.initial
    limits = run_limits(expected_shapes(weights), len(emulation.roster))
    target = Target(
        emulation.fleet, emulation.run_id, emulation.roster, config.learning.rounds, weights, limits
    )
    sampler = PeakSampler(emulation)
    sampler.start()
    sent: dict[str, Any] = {}

    def attack() -> None:
        if payloads:
            sent.update(flood(broker, emulation.fleet, hostile(target, payloads)))

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    os.environ.pop(NO_LIMITS, None)
    if default_limits:
        os.environ[NO_LIMITS] = "1"
    # The agents run `python -m bench.flood agent` under emulate's PYTHONSAFEPATH, which
    # leaves the working directory off their path: the checkout goes on PYTHONPATH.
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), pythonpath]))
    try:
        report = emulation.run()
    finally:
        os.environ.pop(NO_LIMITS, None)
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
    attacker.join(120)
    sampler.done.set()
    sampler.join()
    ends = fleet_round_ends(workdir, emulation.roster)
    return {
        "report": report,
        "peaks": sampler.peaks,
        "sent": sent,
        "round_ends": ends,
        "limits": limits,
    }


# ------------------------------------------------------------------------ the benchmark


def main(argv: list[str] | None = None) -> int:
    from bench.support import broker, environment, write_json
    from coordinator.simulate import Simulation

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--payloads", type=int, default=5000)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--wire", default="delta", choices=["full", "delta", "layers"])
    parser.add_argument("--broker", default="mosquitto", help="mosquitto, embedded or HOST:PORT")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/flood.json")
    args = parser.parse_args(argv)
    config = fleet_config(args.agents, args.rounds, args.wire)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="flood-") as folder:
        workdir = pathlib.Path(folder)
        with broker(args.broker, workdir) as address:
            for name, flooded, default in RUNS:
                count = args.payloads if flooded else 0
                print(f"{name} run ({count} hostile payloads) ...", flush=True)
                runs[name] = run_fleet(
                    config, address, workdir / name, count, default_limits=default
                )
    simulated = Simulation(config).run()
    limits = runs["flooded"]["limits"]
    bound = 2 * limits.max_partial_bytes + SLACK_MB * MB
    rows = {
        agent_id: {name: run["peaks"][agent_id] for name, run in runs.items()}
        for agent_id in sorted(runs["clean"]["peaks"])
    }
    summary = {
        name: {
            "equal_to_simulate": same_learning(run["report"], simulated),
            "sent": run["sent"],
            "flood_overlaps_rounds": overlap(run),
            "max_growth_bytes": max(row[name] - row["clean"] for row in rows.values()),
        }
        for name, run in runs.items()
    }
    within = summary["flooded"]["max_growth_bytes"] <= bound
    print(table(rows, summary, limits, bound))
    ok = within and all(s["equal_to_simulate"] for s in summary.values())
    write_json(
        args.out,
        {
            "config": dataclasses.asdict(config),
            "payloads": args.payloads,
            "limits": dataclasses.asdict(limits),
            "bound_bytes": bound,
            "peaks": rows,
            "runs": summary,
            "within_bound": within,
            "machine": environment(),
        },
    )
    print(f"wrote {args.out}")
    return 0 if ok else 1


def overlap(run: dict[str, Any]) -> str:
    """Which rounds ended while the flood went on."""
    sent, ends = run["sent"], run["round_ends"]
    if "started_at" not in sent:
        return "no flood"
    during = [r for r, at in sorted(ends.items()) if sent["started_at"] <= at <= sent["ended_at"]]
    if not during:
        return f"no round of {max(ends)} ended during the flood"
    return f"rounds {min(during)}..{max(during)} of {max(ends)} ended during the flood"


def table(
    rows: dict[str, dict[str, int]], summary: dict[str, Any], limits: Limits, bound: float
) -> str:
    """The measured figures as a plain text table (it goes into this module's docstring)."""
    names = list(summary)
    lines = [
        f"limits: messages <= {limits.max_message_bytes / MB:.2f} MiB, partial reassembly "
        f"and delivery queue <= {limits.max_partial_bytes / MB:.2f} MiB each; "
        f"bound on growth {bound / MB:.1f} MiB",
        f"{'agent':<10}" + "".join(f"{n + ' MiB':>30}" for n in names),
    ]
    for agent_id, row in rows.items():
        cells = [
            f"{row[n] / MB:.1f} ({(row[n] - row['clean']) / MB:+.1f})"
            if n != "clean"
            else f"{row[n] / MB:.1f}"
            for n in names
        ]
        lines.append(f"{agent_id:<10}" + "".join(f"{c:>30}" for c in cells))
    for name, figures in summary.items():
        lines.append(
            f"{name}: equal to simulate {figures['equal_to_simulate']}; "
            f"{figures['flood_overlaps_rounds']}; sent "
            + ", ".join(f"{k} {v}" for k, v in figures["sent"].items() if not k.endswith("_at"))
        )
    return "\n".join(lines)


def fleet_config(agents: int, rounds: int, wire: str) -> ExperimentConfig:
    """The flooded run: test_emulate's, small and fast."""
    neighbours = min(3, agents - 1)
    learning = preset(
        "dadpfl", rounds=rounds, neighbours=neighbours, epochs=1, max_wait=2, wire=wire
    )
    return ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.5",
        seed=7,
        round_time_s=0.01,
        learning=learning,
    )


def same_learning(emulated: dict[str, Any], simulated: dict[str, Any]) -> bool:
    """Every agent's accuracy and sparsity of every round as simulate has them (1e-6)."""

    def figures(report: dict[str, Any]) -> dict[tuple[int, str], tuple[float, float]]:
        return {
            (r["round"], agent): (a["accuracy"], a["sparsity"])
            for r in report["rounds"]
            for agent, a in r["agents"].items()
        }

    got, want = figures(emulated), figures(simulated)
    return got.keys() == want.keys() and all(
        abs(got[k][0] - want[k][0]) <= 1e-6 and abs(got[k][1] - want[k][1]) <= 1e-6 for k in want
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["agent"]:
        agent_main()
    else:
        raise SystemExit(main())
