"""Which agents a run from the gateway takes: `coordinator.gateway.choose_roster`."""

from __future__ import annotations

from agent.runfile import RunFile, parse_run_table
from coordinator.fleet import AgentEntry
from coordinator.gateway import choose_roster


def agent(name: str, shape: list[int] = [1, 40], labels: list[int] = [0, 1, 2]) -> AgentEntry:  # noqa: B006
    data = {"samples": 100, "shape": shape, "labels": labels}
    return AgentEntry("lab", name, online=True, state="idle", metrics={"data": data})


def run_file(**keys: object) -> RunFile:
    return parse_run_table({"strategy": "dadpfl", **keys}, "run.toml")


def test_the_first_agents_by_id_whose_data_fits_and_misfits_said_once() -> None:
    said: list[str] = []
    seen: set[str] = set()
    available = [agent("d3"), agent("d1"), agent("bad", shape=[3, 8, 8]), agent("d2")]
    runfile = run_file(agents=2)
    roster = choose_roster(available, runfile, seen, said.append)
    assert roster is not None and roster.agents == ["d1", "d2"]
    assert roster.input_shape == (1, 40) and roster.classes == 3, "taken from the agents' data"
    choose_roster(available, runfile, seen, said.append)
    assert said == [
        "agent bad cannot join: samples have shape (3, 8, 8), the run's model takes (1, 40)"
    ]


def test_waits_while_too_few_fit() -> None:
    available = [agent("d1"), agent("d2", labels=[0, 12])]
    runfile = run_file(agents=2, input_shape=[1, 40], classes=10)
    assert choose_roster(available, runfile, set(), lambda _: None) is None


def test_named_agents_go_on_without_a_misfit_once_all_are_there() -> None:
    runfile = run_file(agent_ids=["d1", "d2", "d3"], input_shape=[1, 40], classes=10)
    some = [agent("d1"), agent("d2"), agent("other")]
    assert choose_roster(some, runfile, set(), lambda _: None) is None, "d3 is not there yet"
    every = [*some, agent("d3", labels=[11])]
    roster = choose_roster(every, runfile, set(), lambda _: None)
    assert roster is not None and roster.agents == ["d1", "d2"]


def test_a_malformed_data_description_is_a_misfit_not_an_error() -> None:
    broken = AgentEntry("lab", "x", online=True, state="idle", metrics={"data": {"shape": "big"}})
    runfile = run_file(agents=1, strategy="fedavg", input_shape=[1, 40], classes=10)
    said: list[str] = []
    assert choose_roster([broken], runfile, set(), said.append) is None
    assert said and said[0].startswith("agent x cannot join: ")


def test_a_shared_dataset_run_needs_no_data_description() -> None:
    bare = AgentEntry("lab", "x", online=True, state="idle")
    runfile = parse_run_table({"strategy": "fedavg", "agents": 1, "dataset": "mnist1d"}, "r")
    roster = choose_roster([bare], runfile, set(), lambda _: None)
    assert roster is not None and roster.agents == ["x"]
