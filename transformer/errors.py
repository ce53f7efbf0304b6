"""The project's errors as messages: train.py, eval.py and `python -m transformer.translate` print an error the
project raises for its user (bad data, a refused setting, a workdir or checkpoint that does not fit, a
non-finite loss) as `error: <message>` on stderr, and exit with status 1; `--traceback` shows the traceback
instead. Any other exception is a bug and keeps its traceback.

Exit statuses of the entry points:

    0   finished
    1   an error reported as a message (absl's flag errors and uncaught exceptions exit with 1 too)
    75  preempted: the checkpoint is committed, run the same command again to resume (EX_TEMPFAIL; a SystemExit
        raised by the trainer, passed through unchanged, as is every other SystemExit)
    130 interrupted (Ctrl-C) where no stop handler runs: eval.py, translate; "interrupted" on stderr, no traceback
    1   also a write the disk refuses (full, read-only, no permission): one line naming the file and the fix
    141 stdout closed by its reader (`translate ... | head`): the rest of the output dropped quietly

    if __name__ == "__main__":
        app.run(errors.main_with_messages(main))
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from absl import flags

EXIT_ERROR = 1
EXIT_INTERRUPTED = 128 + 2  # a shell's status for a command ended by SIGINT
EXIT_BROKEN_PIPE = 128 + 13  # ... and by SIGPIPE
TRACEBACK_FLAG = "traceback"


class ConfigError(ValueError):
    """A setting (a config key or a command-line flag) the project refuses; the message names it."""


class ReportedError(Exception):
    """A base for errors whose message tells the user all they need (entry points print it, no traceback):
    `class WorkdirInUseError(errors.ReportedError, RuntimeError)` is reported wherever it is raised."""


# The reported errors that several modules raise live here, below every module that raises or reports them, so
# that this module imports nothing of the package.
class DataError(ValueError):
    """Bad input data: the message names the file/line/key/value at fault."""


class VocabularyError(ValueError):
    """The vocabulary cannot be trained or loaded as asked."""


class CheckpointMismatchError(ValueError):
    """The checkpoint on disk does not fit the model being built."""


def reported_types() -> tuple[type[BaseException], ...]:
    """The exceptions the entry points print as messages: each is raised with a message naming the file, key,
    step or value at fault, so a traceback tells its user nothing more. Types that bugs raise too (a plain
    ValueError, KeyError, TypeError) are not here."""
    return (
        ReportedError,  # raised only to be told to the user
        ConfigError,  # a config key or flag the settings refuse, named with its value
        DataError,  # missing, unreadable or misaligned data, named by file and line
        VocabularyError,  # a vocabulary whose ids this project cannot use, named by path
        CheckpointMismatchError,  # a checkpoint of another model shape, named by its first array
        FileNotFoundError,  # a workdir, checkpoint step, config or input file that is not there, named by path
        NotADirectoryError,  # a --workdir that is a file
        FloatingPointError,  # a non-finite training loss, named by its step (the trainer's stop policy)
    )


# A write the disk refused: the entry points say it in one line naming the file (OSError's own line, e.g. numpy's
# "61071 requested and 37888 written", names neither), with what to do.
WRITE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted"}


def write_error_message(error: OSError) -> str:
    """One line for an OSError of WRITE_ERRNOS: the file, what the disk said, and the fix."""
    where = str(error.filename) if error.filename else "a file"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = ("free space there (or give --workdir, data.local_cache_dir or --output another disk) and run the same "
               "command again: committed checkpoints and files written whole are kept")
    elif error.errno == errno.EROFS:
        fix = "give the command a folder on a writable disk (--workdir, --output)"
    else:
        fix = "check its permissions, or give the command a folder it may use (--workdir, --output)"
    # EACCES and EPERM also answer reads and other calls: only a full or read-only disk is surely a write.
    verb = "cannot write" if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) else "cannot use"
    return f"{verb} {where}: {WRITE_ERRNOS[error.errno]} ({error.strerror}); {fix}"


def nearest(name: str, known: Iterable[str], count: int = 3) -> list[str]:
    """The known names closest to `name` (a misspelling, best first), then those containing it or contained
    in it; [] when none is close. E.g. nearest("num_train_step", train keys) -> ["num_train_steps", ...]."""
    known = list(dict.fromkeys(known))
    close = difflib.get_close_matches(name, known, n=count, cutoff=0.7)
    def overlaps(key: str) -> bool:
        short, long = sorted((name.lower(), key.lower()), key=len)
        return len(short) > 2 and short in long
    close += [k for k in known if k not in close and overlaps(k)]
    return close[:count]


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """'; did you mean a, b?' for the known names nearest `name`, each written after `prefix` (e.g. "train."), else
    '; known: ...' (all of them): the clause that ends a message about an unknown name."""
    known = sorted(known)
    close = nearest(name, known)
    return f"; did you mean {', '.join(prefix + k for k in close)}?" if close else f"; known: {', '.join(known)}"


@contextlib.contextmanager
def as_config_error() -> Iterator[None]:
    """Inside, a plain ValueError (the settings' dataclass checks) becomes a ConfigError with the same message; an
    error already reported as its own kind (a DataError, a CheckpointMismatchError) passes unchanged."""
    try:
        yield
    except ValueError as error:
        if isinstance(error, reported_types()):
            raise
        raise ConfigError(str(error)) from error


def traceback_wanted() -> bool:
    """--traceback: from the parsed flags, or from the command line itself before absl has parsed it."""
    if flags.FLAGS.is_parsed() and TRACEBACK_FLAG in flags.FLAGS:
        return bool(flags.FLAGS[TRACEBACK_FLAG].value)
    return any(arg in ("--traceback", "-traceback", "--traceback=true", "--traceback=True")
               for arg in sys.argv[1:])


@contextlib.contextmanager
def messages() -> Iterator[None]:
    """Inside, a reported error (reported_types) is printed as `error: <message>` on stderr and exits with
    EXIT_ERROR, unless --traceback asks for the traceback; a closed stdout ends quietly (EXIT_BROKEN_PIPE), a
    KeyboardInterrupt with one line (EXIT_INTERRUPTED). SystemExit (75: preempted) passes unchanged."""
    try:
        yield
    except reported_types() as error:
        if traceback_wanted():
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_ERROR) from None
    except BrokenPipeError:
        # The reader of stdout left (`| head`): end quietly as Unix tools do, with a shell's status for SIGPIPE;
        # stdout goes to /dev/null so the interpreter's last flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(EXIT_BROKEN_PIPE) from None
    except OSError as error:  # after the reported types: FileNotFoundError and StorageError are among them
        if error.errno not in WRITE_ERRNOS or traceback_wanted():
            raise
        print(f"error: {write_error_message(error)}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        if traceback_wanted():
            raise
        print("interrupted", file=sys.stderr, flush=True)  # no traceback for a Ctrl-C of eval.py or translate
        raise SystemExit(EXIT_INTERRUPTED) from None


def define_traceback_flag() -> None:
    """--traceback, listed in the entry point's own --help (absl's key flags of the main module)."""
    if TRACEBACK_FLAG not in flags.FLAGS:
        flags.DEFINE_flag(flags.BooleanFlag(
            TRACEBACK_FLAG, False, "On an error the project reports (bad data, a refused setting, a missing workdir or "
            "checkpoint, a non-finite loss), print its full traceback instead of the one-line `error: ...` "
            "(exit status 1 either way)."), module_name=sys.argv[0])


def main_with_messages(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
    """`main` for absl's app.run, reporting the project's errors as messages (`messages`); defines --traceback."""
    define_traceback_flag()

    @functools.wraps(main)
    def run(argv: list[str]) -> Any:
        with messages():
            return main(argv)
    return run
