"""The command-line surface: absl flag definitions and their translation into a `RunConfig`.

Flags are defined on a `FlagValues` passed in, so tests parse flagfiles without touching the global
`absl.flags.FLAGS`. `--flagfile=configs/X.flags` is absl's own.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import flags

from kvgraft_jax.run import config


def _kind(field: dataclasses.Field) -> str:
    """The flag kind of a `RunConfig` field, from its annotation."""
    kinds = {
        "str": "string",
        "int": "integer",
        "float": "float",
        "bool": "boolean",
        "tuple[int, ...]": "int_list",
        "tuple[str, ...]": "str_list",
    }
    kind = kinds.get(str(field.type))
    if kind is None:
        raise TypeError(f"RunConfig.{field.name}: no flag kind for {field.type}")
    return "enum" if field.metadata.get("choices") else kind


def define_flags(fv: flags.FlagValues) -> None:
    """Defines one flag per `RunConfig` field on `fv`: name, type, default and help come from the
    field, so a setting is declared once (`config.setting`)."""
    for field in dataclasses.fields(config.RunConfig):
        kind, help_text = _kind(field), field.metadata["help"]
        args = {"name": field.name, "help": help_text, "flag_values": fv}
        if kind == "enum":
            flags.DEFINE_enum(default=field.default, enum_values=field.metadata["choices"], **args)
        elif kind in ("int_list", "str_list"):
            flags.DEFINE_list(default=[str(v) for v in field.default], **args)
        else:
            getattr(flags, f"DEFINE_{kind}")(default=field.default, **args)


def _int_list(name: str, values: list[str]) -> tuple[int, ...]:
    try:
        return tuple(int(i) for i in values)
    except ValueError:
        raise config.ConfigError(
            f"--{name} must be comma-separated integers, got {','.join(values)!r}"
        ) from None


def config_from_flags(fv: flags.FlagValues) -> config.RunConfig:
    """The validated `RunConfig` of parsed flags; raises `ConfigError` with a one-line message."""
    values = {}
    for field in dataclasses.fields(config.RunConfig):
        value, kind = fv[field.name].value, _kind(field)
        if kind == "int_list":
            value = _int_list(field.name, value)
        elif kind == "str_list":
            value = tuple(value)
        values[field.name] = value
    return config.RunConfig(**values)


def markdown_table() -> str:
    """The README's flag table, generated from the same fields the flags are."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for field in dataclasses.fields(config.RunConfig):
        default = field.default
        if isinstance(default, tuple):
            default = ",".join(str(v) for v in default)
        elif isinstance(default, bool):
            default = str(default).lower()
        shown = f"`{default}`" if default != "" else "(empty)"
        meaning = field.metadata["help"].replace("|", "\\|")
        if field.metadata["choices"]:
            meaning += f" One of {', '.join(f'`{c}`' for c in field.metadata['choices'])}."
        rows.append(f"| `--{field.name}` | {shown} | {meaning} |")
    rows.append(
        "| `--flagfile` | | absl flagfile; every `configs/**/*.flags` is parsed by a test |"
    )
    return "\n".join(rows) + "\n"


def parse(argv: list[str], fv: flags.FlagValues | None = None) -> config.RunConfig:
    """Parses argv (argv[0] is the program) into a config; for tests and notebooks."""
    if fv is None:
        fv = flags.FlagValues()
        define_flags(fv)
    try:
        rest = fv(argv)
    except flags.Error as e:
        raise config.ConfigError(str(e)) from None
    if len(rest) > 1:
        raise config.ConfigError(f"unexpected positional arguments: {' '.join(rest[1:])}")
    return config_from_flags(fv)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m kvgraft_jax.cli.flags --markdown   (the README's flag table)")
    sys.stdout.write(markdown_table())
