"""The command line of a stage, built from its two frozen dataclasses (settings and paths).

A stage declares what it takes once, as dataclass fields with defaults and, in `field(metadata=...)`,
a help text (`help`), allowed values (`choices`), a flag name other than the field's (`flag`), a
metavar or a positional argument (`positional`). This module turns them into an argparse parser
(one `--name` per field, help with defaults and choices, `--x/--no-x` for every on/off switch), parses
argv back into the same dataclasses, and writes them as argv again where a stage must start a
copy of itself in other processes (torchrun). A field whose type is itself a dataclass (a library's
settings, e.g. `QuantizerSettings`) contributes its own fields as options, flat. A rule hands its
values over shaped like the dataclasses, a nested one as a mapping (`from_dict`;
`aqflow.jobs.workflow_glue` shapes them).

`execute` is the one error path of every stage, from a shell or from a rule: an expected input
error (the stage's `INPUT_ERRORS`) is one line `aqflow <stage>: error: ...` and exit code 2; any
other exception is a bug and propagates with its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from aqflow import __version__
from aqflow.stagekit.stage_errors import report as report_error

MISSING = dataclasses.MISSING


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help (not for required options or a default of None);
    the module docstring kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = (action.help or "").strip()
        if action.required or action.default in (None, argparse.SUPPRESS) or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)".strip()


def option(help: str = "", **metadata: Any) -> dict:
    """`field(default=..., metadata=option("what it is", choices=(...)))`."""
    return {"help": help, **metadata}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """(X, True) for `X | None` / Optional[X]; (kind, False) otherwise."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(kind) if member is not type(None)]
        if len(members) == 1:
            return members[0], True
    return kind, False


def _sequence_item(kind: Any) -> Any | None:
    """The item type of tuple[X, ...] / list[X]; None for other types."""
    if typing.get_origin(kind) in (tuple, list):
        args = [arg for arg in typing.get_args(kind) if arg is not Ellipsis]
        return args[0] if args else str
    return None


def _default(spec: dataclasses.Field) -> Any:
    if spec.default is not MISSING:
        return spec.default
    if spec.default_factory is not MISSING:  # type: ignore[misc]
        return spec.default_factory()  # type: ignore[misc]
    return MISSING


def _shown(sequence: Sequence) -> list:
    """A sequence default as argparse keeps it (paths as text, so that help shows them plainly)."""
    return [str(value) if isinstance(value, Path) else value for value in sequence]


def flag_name(spec: dataclasses.Field) -> str:
    return spec.metadata.get("flag") or "--" + spec.name.replace("_", "-")


def add_fields(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
               defaults: Any | None = None) -> None:
    """One argument per field of dataclass `cls` (a nested dataclass field adds its own fields);
    defaults from `defaults` (an instance) when given, else from the dataclass. A field with
    metadata `cli=False` is not an option (set by the caller of `run` only)."""
    types_ = _field_types(cls)
    for spec in dataclasses.fields(cls):
        if spec.metadata.get("cli") is False:
            continue
        kind, _ = _unwrap_optional(types_[spec.name])
        if dataclasses.is_dataclass(kind):  # its fields join this group (argparse does not nest groups)
            add_fields(parser, kind, getattr(defaults, spec.name) if defaults is not None else _default(spec))
            continue
        default = getattr(defaults, spec.name) if defaults is not None else _default(spec)
        # argparse leaves an option without help text bare: give it its default at least
        shown = "(default: %(default)s)" if default not in (MISSING, None) else None
        kwargs: dict[str, Any] = {"help": spec.metadata.get("help") or shown}
        if "metavar" in spec.metadata:
            kwargs["metavar"] = spec.metadata["metavar"]
        if "choices" in spec.metadata:
            kwargs["choices"] = list(spec.metadata["choices"])
        item = _sequence_item(kind)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "append" in spec.metadata:  # a repeatable option of several values: tuple[tuple[str, ...], ...]
            kwargs.update(action="append", nargs=spec.metadata["append"], type=str)
        elif item is not None:
            kwargs["type"] = item
            kwargs["nargs"] = spec.metadata.get("nargs", "*" if default is not MISSING else "+")
        else:
            kwargs["type"] = kind
        if spec.metadata.get("positional"):
            if default is not MISSING:
                kwargs["default"] = _shown(default) if item is not None else default
            parser.add_argument(spec.name, **kwargs)
            continue
        if default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = _shown(default) if item is not None and default is not None else default
        parser.add_argument(flag_name(spec), *spec.metadata.get("aliases", ()), dest=spec.name, **kwargs)


def build_parser(prog: str, description: str | None, settings: type, paths: type) -> argparse.ArgumentParser:
    """A parser for `aqflow <prog>`: the fields of the `paths` dataclass (inputs and outputs), then
    those of `settings`."""
    parser = argparse.ArgumentParser(prog=f"aqflow {prog}", description=description, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"aqflow {__version__}")
    add_fields(parser.add_argument_group("inputs and outputs"), paths)
    add_fields(parser.add_argument_group("settings"), settings)
    return parser


def from_namespace(cls: type, args: argparse.Namespace) -> Any:
    """An instance of dataclass `cls` from parsed arguments (sequences become tuples)."""
    types_ = _field_types(cls)
    values = {}
    for spec in dataclasses.fields(cls):
        if spec.metadata.get("cli") is False:
            continue
        kind, _ = _unwrap_optional(types_[spec.name])
        if dataclasses.is_dataclass(kind):
            values[spec.name] = from_namespace(kind, args)
            continue
        value = getattr(args, spec.name)
        item = _sequence_item(kind)
        if item is not None and value is not None:
            value = tuple(item(entry) if item is Path and isinstance(entry, str) else
                          tuple(entry) if isinstance(entry, list) else entry for entry in value)
        values[spec.name] = value
    return cls(**values)


def parse(parser: argparse.ArgumentParser, classes: Sequence[type], argv: Sequence[str] | None) -> list:
    """argv -> one instance per dataclass of `classes`."""
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        return [from_namespace(cls, args) for cls in classes]
    except ValueError as error:  # a settings class refusing a combination of values (__post_init__)
        parser.error(str(error))


def from_dict(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of dataclass `cls` from plain values shaped like it (a rule's settings): a
    nested dataclass field from a mapping, sequences as tuples, paths as Path. An unknown key is a
    TypeError naming it (the config and the dataclass disagree: a bug, not an input error)."""
    types_ = _field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {unknown}")
    converted = {}
    for name, value in values.items():
        kind, _ = _unwrap_optional(types_[name])
        item = _sequence_item(kind)
        if value is None:
            converted[name] = None
        elif dataclasses.is_dataclass(kind) and isinstance(value, Mapping):
            converted[name] = from_dict(kind, value)
        elif item is not None:
            entries = [value] if isinstance(value, (str, Path)) else value
            converted[name] = tuple(item(entry) if item is Path else
                                    tuple(entry) if isinstance(entry, list) else entry for entry in entries)
        elif kind is Path:
            converted[name] = Path(value)
        else:
            converted[name] = value
    return cls(**converted)


def stage_classes(run: Callable) -> tuple[type, type]:
    """(settings class, paths class) of a stage's `run(settings, paths)`, from its signature."""
    hints = typing.get_type_hints(run, vars(sys.modules[run.__module__]))
    return hints["settings"], hints["paths"]


def to_argv(*instances: Any) -> list[str]:
    """The argv that `parse` turns back into `instances` (for a stage restarting itself in other
    processes): every field, `--x`/`--no-x` for switches, positional fields first."""
    positional: list[str] = []
    options: list[str] = []
    for instance in instances:
        types_ = _field_types(type(instance))
        for spec in dataclasses.fields(instance):
            if spec.metadata.get("cli") is False:
                continue
            value = getattr(instance, spec.name)
            kind, _ = _unwrap_optional(types_[spec.name])
            if dataclasses.is_dataclass(kind):
                options += to_argv(value)
                continue
            if spec.metadata.get("positional"):
                positional += [str(item) for item in value] if _sequence_item(kind) is not None else [str(value)]
                continue
            flag = flag_name(spec)
            if isinstance(value, bool):
                options.append(flag if value else "--no-" + flag[2:])
            elif value is None:
                continue
            elif "append" in spec.metadata:
                for entry in value:
                    options += [flag, *map(str, entry)]
            elif _sequence_item(kind) is not None:
                default = _default(spec)
                if value or default in (None, MISSING) or tuple(default) != tuple(value):  # (): the bare flag
                    options += [flag, *map(str, value)]
            else:
                options += [flag, str(value)]
    return positional + options


def execute(stage: str, run: Callable[[Any, Any], Any], settings: Any, paths: Any,
            input_errors: tuple[type[BaseException], ...], summary: Callable[[Any], str | None]) -> int:
    """Run a stage: 0 and its summary line on stdout, or its one-line input error and 2.
    A bug (any exception not in `input_errors`) propagates with its traceback."""
    try:
        result = run(settings, paths)
    except input_errors as error:
        return report_error(stage, error)
    line = summary(result)
    if line:
        print(line, flush=True)
    return 0


def run_stage_module(module: types.ModuleType, settings: Any, paths: Any) -> int:
    """A stage module's `run(settings, paths)` on the one error path (`execute`): its exit code."""
    return execute(module.STAGE, module.run, settings, paths, module.INPUT_ERRORS, module.summary)


def entry_points(stage: str, description: str | None, run: Callable[[Any, Any], Any],
                 input_errors: tuple[type[BaseException], ...],
                 summary: Callable[[Any], str | None]) -> tuple[Callable[[], argparse.ArgumentParser],
                                                                Callable[[Sequence[str] | None], int]]:
    """(build_parser, main) of a stage module: its parser, built from the dataclasses of `run`'s
    signature, and its command line, `main(argv) -> exit code` (parse, then `execute`)."""
    classes = stage_classes(run)

    def build_stage_parser() -> argparse.ArgumentParser:
        return build_parser(stage, description, *classes)

    def main(argv: Sequence[str] | None = None) -> int:
        settings, paths = parse(build_stage_parser(), classes, argv)
        return execute(stage, run, settings, paths, input_errors, summary)

    return build_stage_parser, main


def default_device() -> str:
    """cuda where a GPU is visible, else cpu (torch imported only when asked)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"

