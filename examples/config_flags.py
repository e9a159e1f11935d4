"""absl flags generated from a config dataclass, documented from its docstring.

Every field of the dataclass becomes one flag, with the field's default as the flag's
default and the field's text in the class docstring's `Attributes:` section as its help,
so the flags cannot drift from the dataclass. A field whose default is a bool, int, float
or str gets the absl flag of that type, and a tuple of ints a comma-separated list. A field
of any other type needs an explicit `FlagConversion`; without one, defining the flags
raises TypeError, so a new field cannot silently lack a flag.

`define_run_flags` defines the flags of `sebulba.Config` (`--envs_per_group`, ...) and
`define_config_flags(agent, ...)` those of an agent's config (`--ppo_learning_rate`, ...).
`run_main(main)` is absl's `app.run` with usage errors as one line (`USAGE_EXIT_CODE`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from absl import app, flags
from absl import logging as absl_logging

import sebulba
from sebulba.envs import registry
from sebulba.envs.wrappers import parse_wrappers

# Flags defined by the functions below belong to the module that calls them (the launcher),
# so that `--helpshort` lists them and `--helpfull` groups them under it.
flags.disclaim_key_flags()


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> text, from the `Attributes:` sections of the class's docstring and of
    its bases' (a config may inherit shared fields, e.g. `policy.ActorCriticOptions`).

    An entry is `name: text` one level below `Attributes:`; lines indented deeper continue
    it; the section ends at a line indented no deeper than `Attributes:`.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__doc__:
            docs.update(_attribute_section(inspect.cleandoc(klass.__doc__)))
    return docs


def _attribute_section(doc: str) -> dict[str, str]:
    docs: dict[str, str] = {}
    name = None
    section_indent = entry_indent = None
    for line in doc.splitlines():
        indent = len(line) - len(line.lstrip())
        if section_indent is None:
            if line.strip() == "Attributes:":
                section_indent = indent
            continue
        if not line.strip():
            continue
        if indent <= section_indent:
            break
        match = re.match(r"^(\w+):\s*(.*)$", line.strip())
        if match and (entry_indent is None or indent <= entry_indent):
            entry_indent = indent
            name = match.group(1)
            docs[name] = match.group(2).strip()
        elif name is not None:
            docs[name] += " " + line.strip()
    return docs


@dataclasses.dataclass(frozen=True)
class FlagConversion:
    """How a field whose type has no natural flag is given on the command line.

    Attributes:
      define: `define(name, default, help, **absl_kwargs)` defines the flag and returns its
        holder; `default` is the field's default, as the dataclass has it.
      parse: `parse(flag_name, flag_value)` is the field's value; raises ValueError naming
        `--flag_name` for a value that does not convert.
    """

    define: Callable[..., flags.FlagHolder]
    parse: Callable[[str, Any], Any]


def _parse_int_tuple(flag_name: str, value: Any) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value)
    except ValueError:
        raise ValueError(f"--{flag_name} must be comma-separated ints, got {value}") from None


def _natural(default: Any) -> FlagConversion | None:
    """The flag of a field with a bool, int, float, str or tuple-of-ints default."""
    if isinstance(default, bool):
        define = flags.DEFINE_boolean
    elif isinstance(default, int):
        define = flags.DEFINE_integer
    elif isinstance(default, float):
        define = flags.DEFINE_float
    elif isinstance(default, str):
        define = flags.DEFINE_string
    elif isinstance(default, tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in default):
        return FlagConversion(
            define=lambda name, default, help, **kw: flags.DEFINE_list(
                name, [str(x) for x in default], help + " (comma-separated ints)", **kw),
            parse=_parse_int_tuple)
    else:
        return None
    return FlagConversion(define=define, parse=lambda flag_name, value: value)


def field_default(cls: type, field: dataclasses.Field) -> Any:
    """The value a field takes when it is not given."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"{cls.__name__}.{field.name} has no default, so no flag default")


class ConfigFlags:
    """The flags of one config dataclass, one per field, and the config they give."""

    def __init__(self, cls: type, prefix: str, module_name: str | None,
                 conversions: dict[str, FlagConversion], flag_values: flags.FlagValues):
        self.cls = cls
        self._flag_values = flag_values
        self._parsers: dict[str, Callable[[str, Any], Any]] = {}
        self.holders: dict[str, flags.FlagHolder] = {}
        unknown = set(conversions) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"conversions for fields {cls.__name__} does not have: {unknown}")
        docs = attribute_docs(cls)
        for field in dataclasses.fields(cls):
            default = field_default(cls, field)
            conversion = conversions.get(field.name) or _natural(default)
            if conversion is None:
                raise TypeError(
                    f"{cls.__name__}.{field.name}: no flag type for its default {default!r}; "
                    "give it a FlagConversion")
            help_text = docs.get(field.name, field.name)
            if prefix:
                help_text = f"{prefix.upper()}: {help_text}"
            kwargs: dict[str, Any] = {"flag_values": flag_values}
            if module_name is not None:
                kwargs["module_name"] = module_name
            name = f"{prefix}_{field.name}" if prefix else field.name
            self.holders[field.name] = conversion.define(name, default, help_text, **kwargs)
            self._parsers[field.name] = conversion.parse

    def flag_name(self, field: str) -> str:
        return self.holders[field].name

    def values(self) -> dict[str, Any]:
        """Field -> value, from the parsed flags; ValueError naming a flag that is bad."""
        return {field: self._parsers[field](holder.name, holder.value)
                for field, holder in self.holders.items()}

    def defaults(self) -> dict[str, Any]:
        """Field -> the value the flags give when none of them is set."""
        return {field: self._parsers[field](holder.name, self._flag_values[holder.name].default)
                for field, holder in self.holders.items()}

    def config(self) -> Any:
        """The config dataclass from the parsed flags; ValueError/TypeError if bad."""
        return self.cls(**self.values())


def define_config_flags(prefix: str, cls: type, module_name: str | None = None,
                        conversions: dict[str, FlagConversion] | None = None,
                        flag_values: flags.FlagValues = flags.FLAGS) -> ConfigFlags:
    """Defines `--<prefix>_<field>` (`--<field>` if prefix is "") for each field of `cls`.

    Flags are grouped under `module_name` in `--helpfull`; by default under the module
    that calls this.
    """
    return ConfigFlags(cls, prefix, module_name, conversions or {}, flag_values)


# --- usage errors ----------------------------------------------------------------------

# The exit code of a usage error (argparse's): a job script can tell a command it must fix
# from a run that failed (1) or was preempted (128 + the signal's number).
USAGE_EXIT_CODE = 2


def usage_exit(message: str) -> NoReturn:
    """Prints a usage error as one line and exits with USAGE_EXIT_CODE.

    absl's `app.UsageError` prints the module's docstring and its flags first (some 70
    lines that scroll the error out of sight); the help stays one flag away.
    """
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "sebulba"
    sys.stderr.write(f"{program}: error: {message}\n"
                     "(--helpshort: this command's flags; --helpfull: every flag)\n")
    sys.exit(USAGE_EXIT_CODE)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parse_flags_with_usage, with a bad flag (unknown, of the wrong type, not one
    of an enum's values) reported as every other usage error is."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        usage_exit(" ".join(str(e).split()))


def run_main(main: Callable[[list[str]], Any]) -> None:
    """`absl.app.run(main)`, with `app.UsageError` and bad flags as a one-line error, and
    absl's logs from WARNING up unless `--verbosity` says otherwise: orbax logs every
    checkpoint step at INFO, dozens of lines through the progress bar and the results."""
    def checked_main(argv: list[str]) -> Any:
        if not flags.FLAGS["verbosity"].present:
            absl_logging.set_verbosity(absl_logging.WARNING)
        try:
            return main(argv)
        except app.UsageError as e:
            usage_exit(str(e))

    app.run(checked_main, flags_parser=_parse_flags)


# --- sebulba.Config ---------------------------------------------------------------------


def _define_env(name, default, help, **kw):
    return flags.DEFINE_string(
        name, default, help + " On the command line an id; a factory only from Python.", **kw)


def _define_env_kwargs(name, default, help, **kw):
    return flags.DEFINE_string(
        name, json.dumps(dict(default)),
        help + ' A JSON object, e.g. \'{"max_episode_steps": 200}\'.', **kw)


def _parse_env_kwargs(flag_name: str, value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--{flag_name} must be a JSON object, got {value!r}: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"--{flag_name} must be a JSON object, got {value!r}")
    return parsed


def _define_env_wrappers(name, default, help, **kw):
    if tuple(default) != ():
        raise TypeError(f"--{name}: the flag knows only the default (), got {default!r}")
    return flags.DEFINE_string(name, "", help, **kw)


def _parse_env_wrappers(flag_name: str, value: str) -> tuple[str, ...]:
    try:
        return parse_wrappers(value)
    except ValueError as e:  # Config's message names the field; the flag's names the flag
        raise ValueError(f"--{e}" if str(e).startswith(flag_name) else str(e)) from None


def _define_devices(name, default, help, **kw):
    if default is not None:
        raise TypeError(f"--{name}: the flag knows only the default None, got {default!r}")
    return flags.DEFINE_list(
        name, None, help + " Comma-separated local device indices; unset: the first local "
        "device.", **kw)


def _parse_devices(flag_name: str, value: list[str] | None) -> list[int] | None:
    if value is None:
        return None
    try:
        indices = [int(v) for v in value]
    except ValueError:
        raise ValueError(
            f"--{flag_name} must be comma-separated local device indices, got {value}") from None
    if not indices:
        raise ValueError(f"--{flag_name} must name at least one local device index "
                         "(leave it unset for the first local device)")
    return indices


def _define_enum(choices: tuple[str, ...]) -> Callable[..., flags.FlagHolder]:
    def define(name, default, help, **kw):
        return flags.DEFINE_enum(name, default, list(choices), help, **kw)
    return define


def _define_vectorization(name, default, help, **kw):
    """An enum of the registered env source kinds, each described in the help."""
    kinds = "; ".join(f"{k}: {registry.get(k).help}" for k in registry.names())
    return flags.DEFINE_enum(name, default, list(registry.names()),
                             f"{help} Registered: {kinds}.", **kw)


def _identity(flag_name: str, value: Any) -> Any:
    return value


# The fields of sebulba.Config whose type has no natural flag, and how they are given.
RUN_FLAG_CONVERSIONS: dict[str, FlagConversion] = {
    # str | EnvFactory: the id only.
    "env": FlagConversion(_define_env, _identity),
    # Mapping[str, Any]: a JSON object.
    "env_kwargs": FlagConversion(_define_env_kwargs, _parse_env_kwargs),
    # Sequence of wrapper names (or callables, from Python): the names, comma-separated.
    "env_wrappers": FlagConversion(_define_env_wrappers, _parse_env_wrappers),
    # str, a registered vectorization: an enum, checked when the flags are parsed.
    "vectorization": FlagConversion(_define_vectorization, _identity),
    # Sequence of device indices or jax.Device | None: comma-separated indices, unset = None.
    "inference_devices": FlagConversion(_define_devices, _parse_devices),
    "learner_devices": FlagConversion(_define_devices, _parse_devices),
    # float | None: a float, unset = None.
    "action_poll_s": FlagConversion(
        lambda name, default, help, **kw: flags.DEFINE_float(name, default, help, **kw),
        _identity),
    # bool | None: --stack_frames_on_device or --nostack_frames_on_device, unset = None.
    "stack_frames_on_device": FlagConversion(
        lambda name, default, help, **kw: flags.DEFINE_bool(name, default, help, **kw),
        _identity),
    # int | None: a local device index, unset = None.
    "eval_device": FlagConversion(
        lambda name, default, help, **kw: flags.DEFINE_integer(name, default, help, **kw),
        _identity),
    # str | None: a directory, unset = None.
    "eval_video_dir": FlagConversion(
        lambda name, default, help, **kw: flags.DEFINE_string(name, default, help, **kw),
        _identity),
    # str, a multiprocessing start method: an enum of this platform's methods.
    "async_context": FlagConversion(
        _define_enum(tuple(multiprocessing.get_all_start_methods())), _identity),
}


def define_run_flags(flag_values: flags.FlagValues = flags.FLAGS) -> ConfigFlags:
    """Defines a flag for each field of `sebulba.Config`, named as the field: the run flags."""
    return define_config_flags("", sebulba.Config, conversions=RUN_FLAG_CONVERSIONS,
                               flag_values=flag_values)
