"""How the `toolkv` command reports failure: one line on stderr naming the problem and a non-zero
exit status, never a traceback (the traceback goes to the log at DEBUG, for `log_level = "debug"`).

A leaf module so every subcommand can raise `CliError` without importing the CLI's entry point
(under `python -m gateway.cli` that module is `__main__`, a different class object).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

EXIT_USAGE = 2  # bad input: arguments, settings, a file
EXIT_FAILURE = 1  # the command ran and failed
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


class CliError(Exception):
    """A failure the user can act on; `message` is shown as is, after `toolkv: `."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def run_reporting_errors(command: Callable[[], int]) -> int:
    """Run `command`; turn any exception into one line on stderr and an exit status."""
    try:
        return command()
    except CliError as exc:
        return _report(exc.message, exc.exit_code)
    except KeyboardInterrupt:
        return _report("interrupted", EXIT_INTERRUPTED)
    except RecursionError as exc:  # a backstop: inputs are depth-checked before anything recursive
        log.debug("recursion limit", exc_info=exc)
        return _report("the input nests too deeply to process", EXIT_USAGE)
    except OSError as exc:
        log.debug("OS error", exc_info=exc)
        return _report(_os_message(exc), EXIT_FAILURE)
    except Exception as exc:  # a bug or an unexpected library error: still no traceback on stderr
        log.debug("unexpected error", exc_info=exc)
        return _report(f"unexpected error ({type(exc).__name__}): {exc}", EXIT_FAILURE)


def one_line(text: str, max_chars: int = 500) -> str:
    """`text` with its line breaks and runs of whitespace folded, cut to `max_chars`."""
    flat = " ".join(text.split())
    return flat if len(flat) <= max_chars else flat[: max_chars - 1] + "…"


def _os_message(exc: OSError) -> str:
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{reason}: {exc.filename}" if exc.filename else reason


def _report(message: str, exit_code: int) -> int:
    print(f"toolkv: {one_line(message)}", file=sys.stderr)
    return exit_code
