"""``cobench data``: prepare real datasets once, outside any training loop.

``cobench data prepare NAME [OPTIONS]`` runs a preparer a workload package declared
(``workloads.base.declare_preparer``): its ``Options`` dataclass becomes the command's options, its
``prepare(options, progress)`` does the work with a ``rich`` progress bar, and what it wrote is
printed. ``cobench data list`` names the preparers.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cli import EXIT_OK

USAGE = "cobench data prepare NAME [OPTIONS] | cobench data list"


def _preparers() -> dict:
    from workloads import discover
    from workloads.base import PREPARERS

    discover()  # each workload package declares its preparers when imported
    return PREPARERS


def _option_type(annotation: Any) -> tuple[Callable[[str], Any], bool]:
    """The argparse ``type`` of a dataclass field's annotation, and whether it takes a list."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _option_type(inner[0])
    if origin is list:
        return _option_type(typing.get_args(annotation)[0])[0], True
    if annotation in (int, float, str, Path):
        return annotation, False
    raise TypeError(f"data preparer option of type {annotation!r} has no command-line form")


def options_parser(name: str, options_class: type, description: str) -> argparse.ArgumentParser:
    """An argument parser for ``cobench data prepare NAME`` made from the preparer's ``Options`` dataclass:
    ``--field-name VALUE`` per field (required when it has no default), ``--flag/--no-flag`` for booleans."""
    parser = argparse.ArgumentParser(prog=f"cobench data prepare {name}", description=description)
    hints = typing.get_type_hints(options_class)
    for option in dataclasses.fields(options_class):
        flag = "--" + option.name.replace("_", "-")
        helptext = option.metadata.get("help", "")
        has_default = option.default is not dataclasses.MISSING or option.default_factory is not dataclasses.MISSING
        default = (option.default if option.default is not dataclasses.MISSING
                   else option.default_factory() if option.default_factory is not dataclasses.MISSING else None)
        if hints[option.name] is bool:
            parser.add_argument(flag, dest=option.name, action=argparse.BooleanOptionalAction, default=default,
                                help=helptext)
            continue
        kind, many = _option_type(hints[option.name])
        extra = f" (default: {default})" if has_default and default not in (None, []) else ""
        parser.add_argument(flag, dest=option.name, type=kind, nargs="+" if many else None, default=default,
                            required=not has_default, help=helptext + extra,
                            metavar=option.name.upper())
    return parser


class _RichProgress:
    """:class:`workloads.base.Progress` drawn with ``rich`` (one bar per task)."""

    def __init__(self, progress: Any):
        self._progress = progress

    def task(self, description: str, total: float | None = None, unit: str = "") -> Callable[[float], None]:
        task_id = self._progress.add_task(f"{description}" + (f" ({unit})" if unit else ""), total=total)
        return lambda amount: self._progress.advance(task_id, amount)


def prepare_main(args: list[str]) -> int:
    preparers = _preparers()
    if not args or args[0] in ("-h", "--help"):
        print("usage: cobench data prepare NAME [OPTIONS]\n\npreparers:")
        for name, spec in sorted(preparers.items()):
            print(f"  {name:12s} {spec.description}")
        print("\n`cobench data prepare NAME --help` lists a preparer's options.")
        return EXIT_OK
    name, rest = args[0], args[1:]
    if name not in preparers:
        raise ValueError(f"unknown data preparer {name!r}; known: {', '.join(sorted(preparers))}")
    spec = preparers[name]
    module = importlib.import_module(spec.module)
    parsed = options_parser(name, module.Options, spec.description).parse_args(rest)
    options = module.Options(**vars(parsed))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=False) as bar:
        summary = module.prepare(options, _RichProgress(bar))
    print(json.dumps(summary, indent=2, default=str))
    return EXIT_OK


def run(args: list[str]) -> int:
    """``cobench data SUBCOMMAND ...``."""
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: {USAGE}\n\n  prepare NAME [OPTIONS]  turn a dataset as distributed into the layout a workload "
              f"reads (once, outside training)\n  list                    the preparers this checkout knows")
        return EXIT_OK
    sub, rest = args[0], args[1:]
    if sub == "prepare":
        return prepare_main(rest)
    if sub == "list":
        for name, spec in sorted(_preparers().items()):
            print(f"{name:12s} {spec.description}")
        return EXIT_OK
    raise ValueError(f"unknown `cobench data` subcommand {sub!r}; usage: {USAGE}")
