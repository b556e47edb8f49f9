"""The exception family for conditions a user can cause (bad input, infeasible plans, testbeds).

The CLI catches `HolmesError`, prints its message on one line (a `TestbedError` may add a failed
rank's log below it) and exits 2. Anything else is a bug and keeps its traceback.
"""


class HolmesError(Exception):
    """Base of every user-facing error."""


class ScenarioError(HolmesError):
    """A scenario file is malformed or describes an impossible set-up."""


class PlanError(HolmesError):
    """A policy cannot build a plan (degrees, transport or memory do not work out); `field`,
    where known, is the dotted path of the scenario value to change."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class TestbedError(HolmesError):
    """The emulated testbed cannot be built or a real run failed (its message may end in a
    failed rank's log, over several lines)."""

    __test__ = False  # not a pytest test class


class FieldError(ScenarioError):
    """A scenario value that is wrong in context; `path` is its dotted path in the file.

    The loader turns it into a message with the file and line of that path.
    """

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def printable(text: str, keep: str = "") -> str:
    """`text` on one line: control characters (a key's newline, a path's escape byte) shown as
    escapes, except those in `keep`."""
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)
