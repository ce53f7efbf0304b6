"""Where `--config=configs/NAME.py` is found: as given (relative to the working directory), else in the `configs`
package installed beside `transformer` (pip installs both), so the shipped configs work from any directory."""

from __future__ import annotations

import os
import sys

import configs

INSTALLED = os.path.dirname(os.path.abspath(configs.__file__))


def find(path: str) -> str:
    """The config file `path` names (a `:argument` suffix kept), or SystemExit naming every place looked."""
    file, sep, argument = path.partition(":")
    if os.path.exists(file):
        return path
    candidate = os.path.join(INSTALLED, os.path.relpath(file, "configs") if not os.path.isabs(file)
                             and file.startswith("configs" + os.sep) else os.path.basename(file))
    if os.path.exists(candidate):
        return candidate + sep + argument
    raise SystemExit(f"--config={path}: no such file; looked at {os.path.abspath(file)} and {candidate} (the "
                     f"installed configs: {', '.join(sorted(n for n in os.listdir(INSTALLED) if n.endswith('.py') and not n.startswith('_')))})")


def resolve_argv(argv: list[str]) -> list[str]:
    """argv with each `--config=PATH` (or `--config PATH`) replaced by the file `find` gives."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            out[i] = "--config=" + find(arg[len("--config="):])
        elif arg == "--config" and i + 1 < len(out):
            out[i + 1] = find(out[i + 1])
    return out


def resolve_sys_argv() -> None:
    sys.argv[:] = resolve_argv(sys.argv)
