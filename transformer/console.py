"""The one console logger, on stderr: the project's progress lines and warnings (`log`), and in the entry points every
library's records too, in the same format (`route_libraries`). stdout carries results only (scores, translations),
so that a pipe reads them alone."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

NAME = "transformer"
# Libraries whose records below a level are left out unless --verbosity asks for them: orbax logs a dozen INFO lines
# per checkpoint saved or restored and warns of the options it adjusts (a read-only manager's), which its errors,
# raised, say better; jax's INFO lines are the backends it probes and the compilation cache.
QUIET_BELOW = {"orbax": logging.ERROR, "jax": logging.WARNING}


class _Stderr(logging.StreamHandler):
    """stderr as it is at each record, not at import, so that a redirection made later (a test's) sees the lines."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _QuietLibraries(logging.Filter):
    """Drops the QUIET_BELOW packages' records below their level, each package known by the file that logged the
    record (absl logs orbax's under its own logger's name)."""

    def __init__(self):
        super().__init__()
        self.levels = []  # (the package's directory, the least level shown)
        for package, level in QUIET_BELOW.items():
            spec = importlib.util.find_spec(package)
            if spec is not None:
                self.levels += [(location, level) for location in spec.submodule_search_locations or ()]

    def filter(self, record: logging.LogRecord) -> bool:
        return all(record.levelno >= level or not record.pathname.startswith(location + os.sep)
                   for location, level in self.levels)


HANDLER = _Stderr()
HANDLER.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))

log = logging.getLogger(NAME)
if HANDLER not in log.handlers:
    log.addHandler(HANDLER)
    log.setLevel(logging.INFO)
    log.propagate = False  # its lines are written once, by HANDLER, whatever the root logger has


def route_libraries() -> None:
    """For an entry point, once absl has parsed its flags (in main): absl's records (orbax's, grain's, tfds', the data
    pipeline's progress) and every record that reaches Python's root logger go to the console's handler instead of
    absl's, at INFO with QUIET_BELOW's left out; --verbosity given sets absl's level for all, those included."""
    from absl import flags
    from absl import logging as absl_logging

    root = logging.getLogger()
    root.removeHandler(absl_logging.get_absl_handler())
    if HANDLER not in root.handlers:
        root.addHandler(HANDLER)
    if not flags.FLAGS["verbosity"].present:  # else absl has set the root level from it
        root.setLevel(logging.INFO)
        if not any(isinstance(f, _QuietLibraries) for f in HANDLER.filters):
            HANDLER.addFilter(_QuietLibraries())


def only_warnings() -> None:
    """One console for a multi-process job: the processes but 0 say only warnings and errors."""
    log.setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
