"""The one exception type for mistakes a user can fix.

Anything raised as ``UserError`` reaches the terminal as a single line (no traceback) and the
process exits with status 2; every other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the problem and the fix, on one line."""
