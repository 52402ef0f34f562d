"""`--help` for the job at hand, `--help-all` for every option: shared by both programs.

A device's operator reads `edge-agent --help` to connect, identify and run a device; dozens
of research hyper-parameters between those options hid them. An option made with
`tucked(SECTION)` is left out of `--help` and listed by `--help-all` under its section's
title. Unlike click's hidden options it still works when given and the shell still
completes it: it is only out of the way.
"""

from __future__ import annotations

from typing import Any

import click

HELP_ALL = "--help-all"

RESEARCH = "Research options"
"""The strategies' hyper-parameters, attacks and the like: for experiments, not devices."""


class TuckedOption(click.Option):
    """An option `--help` leaves out and `--help-all` lists under `section`."""

    def __init__(self, *args: Any, section: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        return None

    def tucked_record(self, ctx: click.Context) -> tuple[str, str] | None:
        """The line `--help-all` shows (None for an option that is hidden as well)."""
        return super().get_help_record(ctx)


def tucked(section: str) -> dict[str, Any]:
    """The keywords that make `click.option(...)` a TuckedOption under `section`."""
    return {"cls": TuckedOption, "section": section}


def full_help(ctx: click.Context) -> str:
    """The command's help as `--help` gives it, with each section of its tucked options
    after its other options (and before a group's commands)."""
    command = ctx.command
    formatter = ctx.make_formatter()
    command.format_usage(ctx, formatter)
    command.format_help_text(ctx, formatter)
    click.Command.format_options(command, ctx, formatter)  # a group's lists its commands too
    sections: dict[str, list[tuple[str, str]]] = {}
    for param in command.get_params(ctx):
        if isinstance(param, TuckedOption) and (record := param.tucked_record(ctx)):
            sections.setdefault(param.section, []).append(record)
    for title, records in sections.items():
        with formatter.section(title):
            formatter.write_dl(records)
    if isinstance(command, click.Group):
        command.format_commands(ctx, formatter)
    command.format_epilog(ctx, formatter)
    return formatter.getvalue().rstrip("\n")


def _show_all(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(full_help(ctx), color=ctx.color)
    ctx.exit()


def with_help_all(command: click.Command) -> click.Command:
    """`command` with a --help-all flag (once, however often it is asked for)."""
    if not any(HELP_ALL in param.opts for param in command.params):
        command.params.append(
            click.Option(
                [HELP_ALL],
                is_flag=True,
                expose_value=False,
                is_eager=True,
                callback=_show_all,
                help="Show this message with every option, those --help leaves out too, and exit.",
            )
        )
    return command


class HelpAllGroup(click.Group):
    """A group whose commands, itself and its sub-groups included, all take --help-all, the
    commands a later change adds too: a user can count on it everywhere."""

    group_class = type

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        with_help_all(self)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        return None if command is None else with_help_all(command)
