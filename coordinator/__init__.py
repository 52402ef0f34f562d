"""The gateway side of edgefl: `simulate` (a whole fleet in one process) with its byte
accounting (`traffic`), `emulate` (a fleet of real agent processes over MQTT), `aggregator`
(the centralized strategies over MQTT), `broker` (the embedded amqtt broker), `fleet` (the
fleet view), `plots` and `cli` (`coordinator`). Modules are imported on use: the broker and
the plots pull in heavy dependencies that `coordinator status` does not need.
"""

__all__ = ["aggregator", "broker", "cli", "emulate", "fleet", "plots", "simulate", "traffic"]
