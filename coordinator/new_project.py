"""`coordinator new NAME`: a project folder that runs at once, from a template shipped with
the package (coordinator/templates).

A newcomer otherwise copies docs/run.example.toml, writes a model's `build()` and a data
loader, and splits a dataset into per-device files by hand before anything runs. A template
holds all of that for one task: a run file, a model, a data loader (the whole fleet's for
simulate and emulate, a device's own on a device), a script that makes a dataset and
splits it into device files, and a README with the next commands. Only the standard
library runs here; the files it writes need numpy and torch, which every install has.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.markup import escape

from coordinator.cli_shared import console

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable  # Python 3.11; importlib.abc before


@dataclass(frozen=True)
class Template:
    """What the shared README says of one template's project (lines as it wraps them)."""

    about: str
    metric: str
    measured: str = ""
    """What the fleet brought on the generated data, measured (a sentence or more ending in a
    newline; none where not measured)."""


TEMPLATES = {
    "classification": Template(
        "Twelve devices learn to tell four machine states apart from 12 sensor readings. A state\n"
        "reads differently at each of 16 operating points, alike on every machine; each device\n"
        "has 150 labelled readings, too few to learn all that alone, sees mostly some of the\n"
        "states and reads its sensors with its own calibration.",
        "accuracy (higher is better)",
        "On the generated data (seeds 1, 2 and 3, each given to `split.py` and `simulate`), 8 or\n"
        "9 of the 12 devices kept their `personal` model, and the mean accuracy beat training\n"
        "alone (`--strategy local`) by 4.7 to 7.5 points.\n",
    ),
    "regression": Template(
        "Twelve devices learn a building's power draw from 8 readings. Every building follows\n"
        "the same partly nonlinear physics, which a device's 150 readings are too few to learn\n"
        "well alone; each building has its own base load and its sensors their own calibration.",
        "mae, the mean absolute error (lower is better)",
        "On the generated data (seeds 1, 2 and 3, each given to `split.py` and `simulate`), 8 or\n"
        "9 of the 12 devices kept their `personal` model, and the mean mae was 16 to 24% lower\n"
        "than training alone's (`--strategy local`).\n",
    ),
    "anomaly": Template(
        "Four devices learn their pump's normal vibration with an autoencoder, whose\n"
        "reconstruction error then flags what is not normal (data/anomalies.npy: windows of\n"
        "failing pumps).",
        "reconstruction_error (lower is better)",
    ),
}
"""The templates, the default first."""

SHIPPED = (".py", ".toml", ".md")
"""The suffixes of a template's files (a stray __pycache__ is not part of it)."""


def template_files(template: str) -> dict[str, Traversable]:
    """A template's files by name: its own folder's and the shared README."""
    root = resources.files("coordinator") / "templates"
    found = {f.name: f for f in (root / template).iterdir() if f.name.endswith(SHIPPED)}
    return {"README.md": root / "README.md", **found}


def create_project(folder: Path, template: str) -> list[str]:
    """Write `template`'s project into `folder` (made if missing) and return the names
    written. ValueError, one line, if `folder` is a file or a folder that holds anything:
    nothing is overwritten."""
    if folder.exists() and not (folder.is_dir() and not any(folder.iterdir())):
        what = "a folder that is not empty" if folder.is_dir() else "a file"
        raise ValueError(f"{folder} is {what}; give `coordinator new` a new name")
    shown = TEMPLATES[template]
    names = {
        "{name}": folder.resolve().name,
        "{template}": template,
        "{about}": shown.about,
        "{metric}": shown.metric,
        "{measured}": shown.measured,
    }
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, source in sorted(template_files(template).items()):
        text = source.read_text(encoding="utf-8")
        if name.endswith((".md", ".toml")):
            for placeholder, value in names.items():
                text = text.replace(placeholder, value)
        with (folder / name).open("x", encoding="utf-8") as out:  # "x": never overwrite
            out.write(text)
        written.append(name)
    return written


@click.command()
@click.argument("name", type=click.Path(path_type=Path))
@click.option(
    "--template",
    type=click.Choice(list(TEMPLATES)),
    default=next(iter(TEMPLATES)),
    show_default=True,
    help="The task of the project's model and generated data.",
)
def new(name: Path, template: str) -> None:
    """Make a project folder NAME that runs at once: a run file, a model, a data loader, a
    script that splits a dataset into device files, and a README."""
    try:
        written = create_project(name, template)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    console.print(
        escape(f"made {name}/ from the {template} template: {', '.join(written)}"), highlight=False
    )
    console.print("next, as its README.md says:")
    for command in (
        f"cd {name}",
        "python split.py",
        "coordinator simulate --run run.toml",
        "coordinator emulate --run run.toml",
    ):
        console.print(escape(f"  {command}"), highlight=False)
