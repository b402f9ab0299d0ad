"""How a command says the user got something wrong: `UsageError` (exit 2) and `JobError`
(exit 1). `launch/cli.py` prints either as one line, `simloop <command>: <message>`, never a
traceback. The ground floor of `launch/`: jobs and the deploy code they call both raise them."""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_USAGE = 2


class JobError(Exception):
    """The job could not do its work for a reason the user can act on (a missing file, a
    server that did not start); the message says what and what to do. Exit 1."""

    exit_code = EXIT_FAILED


class UsageError(JobError):
    """The command line or config asks for something the job cannot do. Exit 2."""

    exit_code = EXIT_USAGE
