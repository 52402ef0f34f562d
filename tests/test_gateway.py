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


def test_a_label_of_the_wrong_type_leaves_its_agent_out_and_the_run_goes_on() -> None:
    """A member's description with labels [0, "x"] once crashed `coordinator run` (a
    TypeError in max); it is that member's misfit now, said once."""
    said: list[str] = []
    available = [agent("d1"), agent("d2"), agent("odd", labels=[0, "x"])]  # type: ignore[list-item]
    roster = choose_roster(available, run_file(agents=2), set(), said.append)
    assert roster is not None and roster.agents == ["d1", "d2"] and roster.classes == 3
    assert len(said) == 1 and said[0].startswith("agent odd cannot join: ")
    assert "'labels' must be a list of integers" in said[0]


def test_one_members_absurd_label_never_sizes_the_run() -> None:
    """Labels 0-9 on the fleet and one member's 99999 made a 100,000-class run; that
    member is left out, said why, and the run has the fleet's 10 classes."""
    said: list[str] = []
    fleet = [agent(f"d{i}", labels=list(range(10))) for i in range(3)]
    available = [*fleet, agent("big", labels=[0, 99999])]
    roster = choose_roster(available, run_file(agents=3), set(), said.append)
    assert roster is not None and roster.classes == 10
    assert roster.agents == ["d0", "d1", "d2"]
    assert said == [
        "agent big cannot join: label 99999 lies far beyond the fleet's labels 0-9 "
        "(a run file with classes = 100000 takes it)"
    ]


def test_labels_a_fleet_explains_are_taken_and_a_run_file_can_want_more() -> None:
    """Two classes a device (pathological splits) still make a fleet's classes; a lone
    agent is its own evidence below the limit; above it, the run file's `classes` says so."""
    split = [agent("a", labels=[0, 1]), agent("b", labels=[4, 5]), agent("c", labels=[8, 9])]
    roster = choose_roster(split, run_file(agents=3), set(), lambda _: None)
    assert roster is not None and roster.classes == 10
    alone = run_file(agents=1, strategy="fedavg")
    lone = choose_roster([agent("a", labels=[0, 37])], alone, set(), lambda _: None)
    assert lone is not None and lone.classes == 38
    many = [agent("a", labels=[0, 4999])]
    assert choose_roster(many, alone, set(), lambda _: None) is None
    wanted = run_file(agents=1, strategy="fedavg", input_shape=[1, 40], classes=5000)
    roster = choose_roster(many, wanted, set(), lambda _: None)
    assert roster is not None and roster.classes == 5000
