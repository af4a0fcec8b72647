"""The two errors a command reports without a traceback (``hf_relpos_cli.main`` catches them). Imports nothing."""


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


class Interrupted(Exception):
    """Ctrl-C: the work so far is saved; ``resume`` is the command that continues it."""

    def __init__(self, message: str, resume: str):
        super().__init__(message)
        self.resume = resume
