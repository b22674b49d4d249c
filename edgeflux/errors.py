"""The one base class of the errors a user fixes: a command line shows their message alone, no traceback.

Torch-free and import-free, so that every layer (the library, the stages, the pipeline's CLI, which
must start fast) can name it. An error class subclasses it beside its usual base (ValueError,
FileNotFoundError, ...), so `except ValueError` still catches it where a caller handles it.
"""


class UserError(Exception):
    """A setting, a file or a machine state the user fixes; the message names what and the fix."""
