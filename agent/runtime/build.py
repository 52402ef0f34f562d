"""An agent by composition: a `Session` (what every run shares), the round driver of its
strategy's topology and, for decentralized rounds, the object of its `--wire` format."""

from __future__ import annotations

from typing_extensions import Unpack

from agent.learning import StrategyConfig
from agent.learning.strategies import strategy
from agent.runtime.buffered import BufferedRounds
from agent.runtime.centralized import CentralizedRounds
from agent.runtime.decentralized import DecentralizedRounds
from agent.runtime.session import RoundDriver, Session, SessionOptions
from agent.runtime.wire_delta import DeltaWire
from agent.runtime.wire_full import FullWire
from agent.runtime.wire_layers import LayersWire

WIRES: dict[str, type[FullWire] | type[DeltaWire] | type[LayersWire]] = {
    "full": FullWire,
    "delta": DeltaWire,
    "layers": LayersWire,
}


def wire_format(cfg: StrategyConfig) -> str:
    """The `--wire` format a decentralized run uses: under `local` nothing is received, so
    models (which are not sent) count as whole."""
    return "full" if strategy(cfg.strategy).alone else cfg.wire


class AgentRuntime:
    """Runs one agent's rounds over an already started transport; takes `Session`'s
    keyword arguments but `expects`, which the wire format sets (the CLI's and the tests'
    entry)."""

    def __init__(self, **options: Unpack[SessionOptions]) -> None:
        cfg = options["run"].config.learning
        self.driver: RoundDriver
        record = strategy(cfg.strategy)
        if record.centralized:
            self.session = Session(**options)
            rounds = BufferedRounds if record.buffered else CentralizedRounds
            self.driver = rounds(self.session)
        else:
            wire = WIRES[wire_format(cfg)]
            expects = wire.expects(options["workload"].learner, options["agent_id"])
            self.session = Session(**options, expects=expects)
            self.driver = DecentralizedRounds(self.session, wire(self.session))

    def run(self) -> None:
        """The run's rounds; whatever they subscribed is dropped at the end, however it
        ends (a long-lived agent takes part in run after run on one transport)."""
        with self.session.transport.scoped_subscriptions():
            self.session.run(self.driver)
