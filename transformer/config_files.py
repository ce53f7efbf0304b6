"""The config files: transformer/defaults.py as the one schema of defaults (`section` gives each typed, validating
dataclass of transformer/ its field defaults from it); where `--config=configs/NAME.py` is found (as given,
relative to the working directory, else in the `configs` package installed beside `transformer`, so the shipped
configs work from any directory); and every `--config.a.b=value` override checked against the config's keys, so
that a misspelt key fails at once, named with the nearest known keys."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import sys
from typing import Any

from ml_collections import ConfigDict
from ml_collections.config_flags import config_flags

from transformer import defaults, errors

# The shipped configs' folder, found without importing the package: the library reads config files by path, as
# ml_collections loads them, and never imports one.
INSTALLED = os.path.dirname(os.path.abspath(importlib.util.find_spec("configs").origin))
# An override as ml_collections reads it: --config.a.b=v, --config.a.b v, or --noconfig.a.b for a false bool.
OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")


@functools.lru_cache(maxsize=1)
def default_values() -> dict[str, Any]:
    """transformer/defaults.py's settings as plain values, read once."""
    return defaults.get_config().to_dict()


def section(name: str):
    """Decorate the frozen dataclass read from `config.<name>`: its fields take their defaults from
    transformer/defaults.py, so that defaults are written once, beside their one-line meaning. A field defaults.py
    lacks has none (a required argument, such as model.vocab_size); a key defaults.py has that the dataclass lacks
    is an error at import."""
    def decorate(cls):
        values = default_values()[name]
        fields = cls.__dict__.get("__annotations__", {})
        extra = sorted(set(values) - set(fields))
        if extra:
            raise TypeError(f"transformer/defaults.py sets config.{name}.{extra[0]}, which {cls.__name__} does not have")
        for field in fields:
            if field in values:
                setattr(cls, field, tuple(values[field]) if isinstance(values[field], list) else values[field])
        return dataclasses.dataclass(frozen=True)(cls)
    return decorate


def plain(config: Any) -> dict[str, Any]:
    """A config as nested plain values, the form config.json holds: transformer/ reads these and dataclasses,
    never a ConfigDict, so a config may come from a config file, a workdir's config.json or a test's dict."""
    tree = config.to_dict() if isinstance(config, ConfigDict) else config
    return {key: plain(value) if isinstance(value, (dict, ConfigDict)) else value for key, value in tree.items()}


def find(path: str) -> str:
    """The config file `path` names (a `:argument` suffix kept), or a ConfigError naming every place looked."""
    file, sep, argument = path.partition(":")
    if os.path.exists(file):
        return path
    candidate = os.path.join(INSTALLED, os.path.relpath(file, "configs") if not os.path.isabs(file)
                             and file.startswith("configs" + os.sep) else os.path.basename(file))
    if os.path.exists(candidate):
        return candidate + sep + argument
    installed = ", ".join(sorted(n for n in os.listdir(INSTALLED) if n.endswith(".py") and not n.startswith("_")))
    raise errors.ConfigError(f"--config={path}: no such file; looked at {os.path.abspath(file)} and {candidate} "
                             f"(the installed configs: {installed})")


def resolve_argv(argv: list[str]) -> list[str]:
    """argv with each `--config=PATH` (or `--config PATH`) replaced by the file `find` gives."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            out[i] = "--config=" + find(arg[len("--config="):])
        elif arg == "--config" and i + 1 < len(out):
            out[i + 1] = find(out[i + 1])
    return out


def config_path(argv: list[str], default: str) -> str:
    """The config file the command line names (the last --config wins, as in absl), else `default`."""
    path = default
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg[len("--config="):]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    return path


def unknown_key(config: ConfigDict, key: str) -> str | None:
    """Why the dotted `key` (an override's path, list indices allowed: `a.b[0]`) names nothing in `config`, with the
    nearest known keys; None when it names a field."""
    node, parts = config, key.split(".")
    for depth, part in enumerate(parts):
        name = re.sub(r"\[[^\]]*\]$", "", part)
        where = "--config." + ".".join(parts[:depth] + [name])
        within = "" if depth == len(parts) - 1 else f" (in --config.{key})"
        if not isinstance(node, (ConfigDict, dict)):
            return f"--config.{'.'.join(parts[:depth])} is a value, not a section with a key {name}{within}"
        if name not in node:
            prefix = "--config." + "".join(p + "." for p in parts[:depth])
            return f"unknown config key {where}{within}" + errors.did_you_mean(name, node.keys(), prefix)
        node = node[name]
    return None


def check_overrides(argv: list[str], default: str) -> None:
    """A ConfigError naming the first `--config.KEY` override of argv whose KEY the config (--config's file, else
    `default`) does not have, with the nearest known keys; ml_collections would stop there with a traceback."""
    keys = [match.group(1) for arg in argv[1:] if (match := OVERRIDE.match(arg))]
    if not keys:
        return
    config = config_flags.ConfigFileFlagParser(name="config", lock_config=False).parse(config_path(argv, default))
    problems = [problem for key in keys if (problem := unknown_key(config, key))]
    if problems:
        problem, more = problems[0], len(problems) - 1
        raise errors.ConfigError(problem + (f" (and {more} more unknown key(s))" if more else ""))


def resolve_sys_argv(default: str | None = None) -> None:
    """sys.argv with its --config file found (`find`); with `default` (the entry point's default config file), its
    overrides checked too (`check_overrides`). Raises ConfigError; call it before absl parses the flags."""
    sys.argv[:] = resolve_argv(sys.argv)
    if default is not None:
        check_overrides(sys.argv, default)
