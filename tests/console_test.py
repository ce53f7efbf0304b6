"""The one console logger (transformer/console.py): the project's lines and, in an entry point, absl's and the
libraries' records, in one format on stderr, with orbax's notices left out unless --verbosity asks; stdout holds only
what the program prints as its result."""

import os
import re
import subprocess
import sys

import orbax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# An entry point as train.py's: absl parses the flags, main routes the libraries' records, then logs and prints.
PROGRAM = """
import logging, sys
from absl import app, logging as absl_logging
from transformer import console

def main(argv):
    console.route_libraries()
    console.log.info("a progress line")
    absl_logging.info("the data pipeline's notice")
    for level, text in ((logging.INFO, "an orbax notice"), (logging.WARNING, "an orbax warning"),
                        (logging.ERROR, "an orbax error")):  # as absl logs orbax's: under its own logger's name
        logging.getLogger("absl").handle(logging.LogRecord("absl", level, sys.argv[1], 1, text, None, None))
    print("the result")

app.run(main)
"""


def run(*flags):
    orbax_file = os.path.join(list(orbax.__path__)[0], "checkpoint", "checkpoint_manager.py")
    result = subprocess.run([sys.executable, "-c", PROGRAM, orbax_file, *flags], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, [line for line in result.stderr.splitlines() if line.strip()]


def test_every_record_goes_to_stderr_in_one_format_and_orbax_notices_only_when_asked():
    stdout, lines = run()
    assert stdout == "the result\n"
    assert all(re.match(r"^\d\d:\d\d:\d\d ", line) for line in lines), lines
    assert [line[9:] for line in lines] == ["a progress line", "the data pipeline's notice", "an orbax error"]
    _, verbose = run("--verbosity=0")
    assert [line[9:] for line in verbose] == ["a progress line", "the data pipeline's notice", "an orbax notice",
                                              "an orbax warning", "an orbax error"]
