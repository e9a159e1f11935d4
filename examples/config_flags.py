"""absl flags generated from a config dataclass, documented from its docstring."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from absl import flags


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> text, from an `Attributes:` section of the class docstring."""
    doc = inspect.getdoc(cls) or ""
    docs: dict[str, str] = {}
    name = None
    in_attributes = False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            in_attributes = True
            continue
        if not in_attributes:
            continue
        match = re.match(r"^\s{2,4}(\w+):\s*(.*)$", line)
        if match:
            name = match.group(1)
            docs[name] = match.group(2).strip()
        elif name and line.startswith(" " * 5) and line.strip():
            docs[name] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return docs


def define_config_flags(prefix: str, cls: type, module_name: str) -> dict[str, Any]:
    """Defines `--<prefix>_<field>` for each field of dataclass `cls`; returns the holders.

    Flags are grouped under `module_name` in `--helpfull`.
    """
    docs = attribute_docs(cls)
    holders = {}
    for field in dataclasses.fields(cls):
        default = field.default
        name = f"{prefix}_{field.name}"
        help_text = f"{prefix.upper()}: {docs.get(field.name, field.name)}"
        kwargs = {"module_name": module_name}
        if isinstance(default, bool):
            holders[field.name] = flags.DEFINE_boolean(name, default, help_text, **kwargs)
        elif isinstance(default, int):
            holders[field.name] = flags.DEFINE_integer(name, default, help_text, **kwargs)
        elif isinstance(default, float):
            holders[field.name] = flags.DEFINE_float(name, default, help_text, **kwargs)
        elif isinstance(default, str):
            holders[field.name] = flags.DEFINE_string(name, default, help_text, **kwargs)
        elif isinstance(default, tuple) and all(isinstance(x, int) for x in default):
            holders[field.name] = flags.DEFINE_list(
                name, [str(x) for x in default], help_text + " (comma-separated ints)", **kwargs)
        else:
            raise TypeError(f"{cls.__name__}.{field.name}: no flag type for {default!r}")
    return holders


def config_from_flags(cls: type, holders: dict[str, Any]) -> Any:
    """An instance of `cls` from the flag values; ValueError naming a bad value."""
    values = {}
    for field in dataclasses.fields(cls):
        value = holders[field.name].value
        if isinstance(field.default, tuple):
            try:
                value = tuple(int(x) for x in value)
            except ValueError:
                raise ValueError(
                    f"--{holders[field.name].name} must be comma-separated ints, got {value}"
                ) from None
        values[field.name] = value
    return cls(**values)
