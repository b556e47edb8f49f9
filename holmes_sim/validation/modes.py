"""The modes of `holmes-sim validate` that take no testbed run (`--published`, `--cleanup`,
`--dry-run`): the options each uses, so that one given to a mode that ignores it is refused by
name instead of silently dropped."""

from __future__ import annotations

MODE_USES = {
    "--published": (("--json", "--wide"), "it checks the simulator against published measurements"),
    "--cleanup": ((), "it removes what killed runs left; it reads no testbed, writes no result"),
    "--dry-run": (("a testbed", "--policy"), "it builds groups and stages, writes no result"),
}
"""The options each mode uses, and what it does instead of the others."""


def unused_options(mode: str, given: dict[str, object]) -> str | None:
    """The usage error for the options of `given` (name -> value) set but unused by `mode`
    (a key of `MODE_USES`), or None when there are none."""
    uses, why = MODE_USES[mode]
    unused = [name for name, value in given.items() if value and name not in (mode, *uses)]
    if not unused:
        return None
    return (f"{mode} does not use {', '.join(unused)}; drop "
            f"{'it' if len(unused) == 1 else 'them'} ({why})")
