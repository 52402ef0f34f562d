"""Flower's Ray simulation of one `bench.sim_scale` FedAvg cell, as a program of its own.

    python -m bench.flower_sim SPEC_JSON

`bench.sim_scale` runs this with the Python of a separate environment that has Flower
(`FLOWER_PYTHON`, default /tmp/flwr-venv/bin/python): Flower's simulation pins a Ray of its
own (flwr 1.42: Ray 2.55.1) and its typer pin conflicts with the gateway extra's amqtt, so it
is never installed next to edgefl. Set it up once:

    python3 -m venv /tmp/flwr-venv
    /tmp/flwr-venv/bin/pip install torch==2.13.0   # the CPU build, as scripts/setup.sh pins it
    /tmp/flwr-venv/bin/pip install 'flwr[simulation]==1.42.0'
    /tmp/flwr-venv/bin/pip install -e .            # edgefl's base install, no extras

(`pip install -e .` puts edgefl's base dependencies there; the bench runs this tree's code
through PYTHONPATH all the same.)

The task is the one the simulator runs for the same spec (`bench.sim_scale.config_of`): our
model, our data split, our FedAvg participant's local SGD (`studies.vs_flower.run_flower`:
Flower replaces the orchestration and the aggregation, every client every round, one CPU a
client actor). It prints one JSON line: each round's end (epoch seconds, when Flower's
`evaluate_fn` returned for it), the wall seconds and this process's peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's FedAvg run on Flower: its round ends and figures."""
    import flwr

    from bench.sim_scale import config_of
    from studies.vs_flower import run_flower

    started = time.time()
    ends, figures = run_flower(config_of(spec))
    return {
        "ends": {str(t): end for t, end in ends.items()},
        "started": started,
        "wall_s": figures["wall_s"],
        "rounds_done": figures["rounds_done"],
        "failed": figures["failed"],
        "driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "flwr": flwr.__version__,
    }


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
