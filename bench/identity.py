"""Behaviour identity check: the same configurations give the same reports before and after a
change that must not alter behaviour (a refactoring).

`record DIR` runs every configuration below through `coordinator simulate` and writes one JSON
report per configuration into DIR; `compare DIR` runs them again and compares each report with
the recorded one, wall times aside. The configurations cover every preset, every `--wire`,
every `--reduce`, channel masks, early stopping, device profiles, fp16 and both detection
distances; a configuration the recording lacks (added since) is listed as new. A
configuration whose `--reduce` chooses by measured costs compares with the cost table the
recording measured (kept beside its report, NAME.costs.json), not with a new measurement.
`emulate` runs a few configurations as real agent processes on the embedded broker and checks
that every agent's accuracy and sparsity in every round equal simulate's.

    python -m bench.identity record /tmp/before      # on the old code
    python -m bench.identity compare /tmp/before     # on the new code
    python -m bench.identity compare /tmp/before --workers 2   # trained in 2 processes
    python -m bench.identity compare /tmp/before --old-training
    python -m bench.identity emulate

`--old-training` runs every configuration with the local training and model keeping of
before issue 45 (plain SGD at lr 0.1, no momentum, no clipping, the strategy's own model
kept, the paper's detection score): what a change of those defaults alone leaves as it was.
Figures a report gained since the recording (the model a device kept, say) are left out of
the comparison, as configuration fields added since are.

Prints a table and writes bench/results/identity.json.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from click.testing import CliRunner

import coordinator.simulate as simulate_module
from agent.learning.config import ADAM_FAMILY
from agent.learning.costs import CostTable
from agent.learning.early_stop import STOP_RULES
from agent.learning.precision import ComputeFormat
from coordinator.cli import main as coordinator

SMALL = ["--dataset", "mnist1d", "--agents", "6", "--rounds", "5", "--epochs", "1", "--seed", "3"]
CONFIGS: dict[str, str] = {
    "dadpfl-squared": "--strategy dadpfl --detection-distance squared --neighbours 3",
    "dadpfl-norm-prunes": (
        "--strategy dadpfl --detection-distance norm --neighbours 3 --rounds 12 --delta-pr 100"
    ),
    "dadpfl-fp16": "--strategy dadpfl --detection-distance norm --neighbours 3 --fp16",
    "dadpfl-early-stop": (
        "--strategy dadpfl --detection-distance squared --neighbours 3 --rounds 8 --early-stop "
        "--stop-rule paper"
    ),
    "dadpfl-patience": (
        "--strategy dadpfl --detection-distance norm --neighbours 3 --rounds 8 --early-stop "
        "--stop-rule paper --stop-patience 2"
    ),
    "dadpfl-mixed": (
        "--strategy dadpfl --detection-distance norm --neighbours 3 --profiles mixed "
        "--round-time-s 0.01"
    ),
    "dadpfl-prune": (
        "--strategy dadpfl --detection-distance norm --profiles mixed --round-time-s 0.01 "
        "--reduce prune --neighbours 3"
    ),
    "dadpfl-freeze": (
        "--strategy dadpfl --detection-distance norm --profiles mixed --round-time-s 0.01 "
        "--reduce freeze --neighbours 3"
    ),
    "dadpfl-auto": (
        "--strategy dadpfl --detection-distance norm --rounds 10 --delta-pr 100 --profiles mixed "
        "--round-time-s 0.01 --reduce auto --neighbours 3"
    ),
    "dadpfl-delta": (
        "--strategy dadpfl --detection-distance norm --rounds 10 --delta-pr 100 --neighbours 3 "
        "--wire delta --delta-fraction 0.2"
    ),
    "dadpfl-delta-fp16-stop": (
        "--strategy dadpfl --detection-distance norm --neighbours 3 --wire delta --fp16 --rounds "
        "8 --early-stop --stop-rule paper"
    ),
    "dadpfl-layers": (
        "--strategy dadpfl --detection-distance norm --rounds 10 --delta-pr 100 --neighbours 3 "
        "--wire layers --ldf-n 1"
    ),
    "dadpfl-layers-stop": (
        "--strategy dadpfl --detection-distance squared --neighbours 3 --wire layers --ldf-n 2 "
        "--rounds 8 --early-stop --stop-rule paper --fp16"
    ),
    "dadpfl-auto-layers-fp16": (
        "--strategy dadpfl --detection-distance norm --profiles mixed --round-time-s 0.01 "
        "--reduce auto --wire layers --ldf-n 1 --fp16 --neighbours 3"
    ),
    "dadpfl-channels": (
        "--strategy dadpfl --mask-unit channel --detection-distance norm --rounds 10 "
        "--delta-pr 100 --profiles mixed --round-time-s 0.01 --neighbours 3"
    ),
    "dispfl": "--strategy dispfl --neighbours 3",
    "dispfl-freeze": (
        "--strategy dispfl --profiles mixed --round-time-s 0.01 --reduce freeze --neighbours 3"
    ),
    "dispfl-delta": "--strategy dispfl --neighbours 3 --wire delta",
    "dfedavgm": "--strategy dfedavgm --neighbours 3",
    "dfedavgm-layers": "--strategy dfedavgm --neighbours 3 --wire layers",
    "dfedavgm-ring": "--strategy dfedavgm --topology ring --max-wait 0",
    "local": "--strategy local",
    "local-stop": "--strategy local --rounds 8 --early-stop --stop-rule paper",
    "fedavg": "--strategy fedavg",
    "fedavg-fp16-stop": "--strategy fedavg --fp16 --rounds 8 --early-stop --stop-rule paper",
    "fedavg-ft": "--strategy fedavg-ft",
    "fedspu": "--strategy fedspu",
    "fedspu-mixed-fp16": "--strategy fedspu --profiles mixed --round-time-s 0.01 --fp16",
    "feddrop": "--strategy feddrop",
    "fedadam": "--strategy fedadam",
    "fedadam-top": "--strategy fedadam-top --ssm-fraction 0.2",
    "fedadam-ssm": "--strategy fedadam-ssm",
    "fedadam-ssm-fp16-stop": (
        "--strategy fedadam-ssm --fp16 --rounds 8 --early-stop --stop-rule paper"
    ),
    "fedldf": "--strategy fedldf",
    "fedldf-n2-mixed": "--strategy fedldf --ldf-n 2 --profiles mixed --round-time-s 0.01",
    "digits-dadpfl": "--strategy dadpfl --detection-distance norm --dataset digits --neighbours 3",
    "digits-fedavg": "--strategy fedavg --dataset digits",
}
"""Each configuration's flags for `coordinator simulate`, on top of `SMALL`."""
EMULATED = (
    "dadpfl-squared",
    "dadpfl-delta",
    "dadpfl-layers",
    "dadpfl-channels",
    "fedavg",
    "fedspu-mixed-fp16",
)
WALL_KEYS = {"wall_seconds"}


@contextlib.contextmanager
def pinned_costs(path: Path, keep: bool) -> Iterator[None]:
    """`--reduce auto` (and prefix, width) choose by the costs measured on this machine now,
    and no two measurements agree to the last digit: the recording keeps the table each
    configuration measured (`keep`), and a comparison trains with that table rather than a
    new measurement, so what it compares is the code, not the machine's load."""
    measure = simulate_module.measure_costs

    def pinned(facts: Any, data: Any, **options: Any) -> CostTable:
        if keep or not path.is_file():
            table = measure(facts, data, **options)
            if keep:
                path.write_text(json.dumps(table.to_dict()))
            return table
        table = CostTable.from_dict(json.loads(path.read_text()))
        facts.compute_format = ComputeFormat.parse(table.format)  # as measuring sets it
        return table

    simulate_module.measure_costs = pinned
    try:
        yield
    finally:
        simulate_module.measure_costs = measure


def simulate(
    name: str, folder: Path, extra: tuple[str, ...] = (), costs: Path | None = None
) -> dict[str, Any]:
    """Run configuration `name` through the CLI; returns its report. With `costs` (a
    recording's folder), the cost table it kept for `name` is used or, when recording, kept."""
    path = folder / f"{name}.json"
    args = ["simulate", *SMALL, *CONFIGS[name].split(), *extra, "--report", str(path)]
    pinning = (
        contextlib.nullcontext()
        if costs is None
        else pinned_costs(costs / f"{name}.costs.json", keep=costs == folder)
    )
    with pinning:
        result = CliRunner().invoke(coordinator, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise SystemExit(f"{name}: exit {result.exit_code}: {result.output}")
    return json.loads(path.read_text())


def without_wall(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_wall(v) for k, v in value.items() if k not in WALL_KEYS}
    if isinstance(value, list):
        return [without_wall(v) for v in value]
    return value


def recorded_fields(got: Any, want: Any) -> Any:
    """`got` with only the fields the recording has, at every level of its dicts and lists
    (a strategy option added since is in `config.learning`, a figure in each agent's)."""
    if isinstance(got, dict) and isinstance(want, dict):
        return {k: recorded_fields(v, want[k]) for k, v in got.items() if k in want}
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        return [recorded_fields(g, w) for g, w in zip(got, want, strict=True)]
    return got


def old_training(name: str) -> tuple[str, ...]:
    """The flags that give configuration `name` the defaults of before issue 45: plain SGD
    (a preset's own fixed values aside), the strategy's model kept, the paper's score."""
    given = CONFIGS[name].split()
    strategy = given[given.index("--strategy") + 1]
    flags: tuple[str, ...] = ("--fallback", "off")
    if strategy not in ADAM_FAMILY:
        flags += ("--optimizer", "sgd", "--lr", "0.1", "--clip-norm", "0")
    if strategy != "dfedavgm":  # its preset fixes momentum 0.9
        flags += ("--momentum", "0")
    if strategy == "dadpfl":
        flags += ("--detection-scale", "first")
    if "--delta-pr" not in given:
        flags += ("--delta-pr", "0.02")
    return flags


def same_patience(got: dict[str, Any], want: dict[str, Any]) -> None:
    """`--stop-patience` 0 means the rule's own default since `--stop-rule` came (1 under
    `paper`), and means nothing without early stopping: write the recording's value where
    ours says the same."""
    learning, recorded = got.get("learning", {}), want.get("learning", {})
    if learning.get("stop_patience") == 0 and "stop_patience" in recorded:
        unused = not learning.get("early_stop")
        if unused or STOP_RULES[learning.get("stop_rule", "paper")] == recorded["stop_patience"]:
            learning["stop_patience"] = recorded["stop_patience"]


def first_difference(want: Any, got: Any, where: str = "") -> str | None:
    """Where two reports first differ (a JSON path), or None."""
    if type(want) is not type(got):
        return f"{where}: {type(want).__name__} vs {type(got).__name__}"
    if isinstance(want, dict):
        if want.keys() != got.keys():
            return f"{where}: keys {sorted(want.keys() ^ got.keys())}"
        for key in want:
            if (found := first_difference(want[key], got[key], f"{where}.{key}")) is not None:
                return found
        return None
    if isinstance(want, list):
        if len(want) != len(got):
            return f"{where}: length {len(want)} vs {len(got)}"
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            if (found := first_difference(a, b, f"{where}[{i}]")) is not None:
                return found
        return None
    return None if want == got else f"{where}: {want!r} vs {got!r}"


def record(folder: Path) -> list[dict[str, Any]]:
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in CONFIGS:
        started = time.perf_counter()
        report = simulate(name, folder, costs=folder)
        rows.append(
            {
                "config": name,
                "rounds": len(report["rounds"]),
                "seconds": round(time.perf_counter() - started, 1),
                "result": "recorded",
            }
        )
        print(f"{name}: recorded", flush=True)
    return rows


def compare(folder: Path, extra: tuple[str, ...] = (), old: bool = False) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in CONFIGS:
            if not (folder / f"{name}.json").is_file():  # a configuration added since
                rows.append({"config": name, "rounds": 0, "seconds": 0, "result": "new"})
                print(f"{name}: new, not recorded", flush=True)
                continue
            want = without_wall(json.loads((folder / f"{name}.json").read_text()))
            started = time.perf_counter()
            flags = extra + (old_training(name) if old else ())
            got = without_wall(simulate(name, Path(scratch), flags, costs=folder))
            # A field added since the recording (with its default) is no change.
            got = recorded_fields(got, want)
            same_patience(got["config"], want["config"])
            difference = first_difference(want, got)
            rows.append(
                {
                    "config": name,
                    "rounds": len(got["rounds"]),
                    "seconds": round(time.perf_counter() - started, 1),
                    "result": "identical" if difference is None else f"DIFFERS {difference}",
                }
            )
            print(f"{name}: {rows[-1]['result']}", flush=True)
    return rows


def emulate() -> list[dict[str, Any]]:
    """Emulate a few configurations; each agent's accuracy and sparsity must equal simulate's."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for name in EMULATED:
            path = folder / f"{name}-emulated.json"
            args = [
                "emulate",
                *SMALL,
                *CONFIGS[name].split(),
                "--rounds",
                "3",
                "--report",
                str(path),
                "--workdir",
                str(folder / name),
            ]
            simulated = simulate(name, folder, ("--rounds", "3"))
            started = time.perf_counter()
            result = CliRunner().invoke(coordinator, args, catch_exceptions=False)
            if result.exit_code != 0:
                raise SystemExit(f"{name}: emulate exit {result.exit_code}: {result.output}")
            emulated = json.loads(path.read_text())
            mismatched = [
                f"round {r['round']} {k}"
                for r, s in zip(emulated["rounds"], simulated["rounds"], strict=False)
                for k, a in r["agents"].items()
                if (a["accuracy"], a["sparsity"])
                != (s["agents"][k]["accuracy"], s["agents"][k]["sparsity"])
            ]
            same_rounds = len(emulated["rounds"]) == len(simulated["rounds"])
            ok = same_rounds and not mismatched
            rows.append(
                {
                    "config": name,
                    "rounds": len(emulated["rounds"]),
                    "seconds": round(time.perf_counter() - started, 1),
                    "result": "equals simulate" if ok else f"DIFFERS {mismatched[:3]}",
                }
            )
            print(f"{name}: {rows[-1]['result']}", flush=True)
    return rows


def main(argv: list[str]) -> int:
    mode, args = (argv[0], argv[1:]) if argv else ("", [])
    old = "--old-training" in args
    args = [a for a in args if a != "--old-training"]
    valid = {
        "record": len(args) == 1,
        "compare": len(args) == 1 or (len(args) == 3 and args[1] == "--workers"),
        "emulate": not args,
    }
    if not valid.get(mode):
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    if mode == "emulate":
        rows = emulate()
    elif mode == "record":
        rows = record(Path(args[0]))
    else:
        rows = compare(Path(args[0]), tuple(args[1:]), old)
    print(f"\n{'config':<26} {'rounds':>6} {'seconds':>8}  result")
    for row in rows:
        print(f"{row['config']:<26} {row['rounds']:>6} {row['seconds']:>8}  {row['result']}")
    out = Path(__file__).parent / "results" / f"identity-{mode}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r["result"].startswith("DIFFERS")]
    print(
        f"\n{len(rows) - len(failed)} of {len(rows)} {mode}: "
        + ("all as before" if not failed else f"{len(failed)} differ")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
