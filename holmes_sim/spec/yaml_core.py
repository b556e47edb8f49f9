"""YAML text -> node tree, read as YAML 1.2's core schema reads plain scalars, within limits.

PyYAML implements YAML 1.1, whose implicit types surprise: `8:32` is 512 (base 60), `0x200`,
`0o1000`, `01000` and `5_12` are 512, and yes/no/on/off are booleans. Here a plain scalar is
- an int only as a plain decimal: an optional sign, then `0` or digits without a leading zero;
- a float only as a decimal with a point or an exponent (`0.5`, `.5`, `1e9`, `-2.5E-3`), or
  `.inf`, `-.inf`, `.nan` in the core schema's spellings (the loader refuses those as non-finite);
- a bool only as true/True/TRUE or false/False/FALSE;
- null as `null`/`Null`/`NULL`, `~` or nothing;
- a string otherwise (timestamps too).
The core schema also reads `0x`/`0o` forms as ints; they are strings here as well, so every form
that YAML 1.1 and 1.2 read differently, or that reads as another number than it shows, reaches
the schema check as text and is refused where a number belongs (`load`).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from holmes_sim.errors import ScenarioError

MAX_DEPTH = 32
"""Deepest nesting of mappings and lists (a scenario needs about 6)."""
MAX_ALIASES = 100
"""Most `*alias` references in one file."""

TAG = "tag:yaml.org,2002:"
"""The prefix of YAML's standard tags (`tag:yaml.org,2002:int`, ...)."""
_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)\Z")
_FLOAT = re.compile(r"""(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?
                        |[-+]?[0-9]+[eE][-+]?[0-9]+
                        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z""", re.X)
CORE_FORMS: dict[str, tuple[re.Pattern[str], str]] = {
    f"{TAG}null": (re.compile(r"(?:~|null|Null|NULL|)\Z"), "~nN"),
    f"{TAG}bool": (re.compile(r"(?:true|True|TRUE|false|False|FALSE)\Z"), "tTfF"),
    f"{TAG}int": (_INT, "-+0123456789"),
    f"{TAG}float": (_FLOAT, "-+0123456789."),
}
"""The plain-scalar form of each non-string type, and the characters it can start with (a
value outside them is a string)."""


class CoreResolver(yaml.resolver.BaseResolver):
    """Resolves plain scalars by `CORE_FORMS` (the module docstring), nothing by YAML 1.1."""


for _tag, (_form, _first) in CORE_FORMS.items():
    CoreResolver.add_implicit_resolver(_tag, _form, [*_first, ""] if _tag.endswith("null")
                                       else list(_first))


def core_form(tag: str, text: str) -> bool:
    """Whether `text` is written as YAML 1.2 writes a `tag` value (an int is a float too)."""
    if tag == f"{TAG}float" and _INT.match(text):
        return True
    form = CORE_FORMS.get(tag)
    return form is None or form[0].match(text) is not None


def yaml11_reading(text: str) -> Any:
    """What YAML 1.1 (PyYAML's own loader) reads plain `text` as, when that is not the text:
    a number or a bool; None otherwise, and for text over 64 characters (a long base-60 number
    takes quadratic time)."""
    if len(text) > 64:
        return None
    tag = yaml.resolver.Resolver().resolve(yaml.ScalarNode, text, (True, False))
    if tag not in (f"{TAG}int", f"{TAG}float", f"{TAG}bool"):
        return None
    try:
        return yaml.constructor.SafeConstructor().construct_object(yaml.ScalarNode(tag, text))
    except (ValueError, yaml.YAMLError):
        return None


class _CoreDumper(yaml.SafeDumper):
    """SafeDumper that also quotes the strings YAML 1.2 would read as numbers (`1e9`), so that
    what it writes reads back the same under either schema."""


_CoreDumper.add_implicit_resolver(f"{TAG}float", _FLOAT, list("-+0123456789."))


class Written(str):
    """A number's text as its file wrote it (`1.50`, `007`), with the tag it resolved to:
    `dump` writes it back as written, so a text field reading it again gets the same text and a
    number field the same number (`spec.load.load_plain(..., as_written=True)`)."""

    tag: str

    def __new__(cls, text: str, tag: str) -> Written:
        written = super().__new__(cls, text)
        written.tag = tag
        return written

    def __deepcopy__(self, memo: dict) -> Written:
        return self

    def __reduce__(self):
        return Written, (str(self), self.tag)


_CoreDumper.add_representer(Written, lambda dumper, w: dumper.represent_scalar(w.tag, str(w)))


def dump(data: Any) -> str:
    """`data` as YAML text that `compose_limited` reads back as the same values."""
    return yaml.dump(data, Dumper=_CoreDumper, sort_keys=False)


class _Limits:
    """A composer that refuses deep nesting and many aliases (mixed in before `Composer`)."""

    depth = 0
    aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _LimitError(mark, f"more than {MAX_ALIASES} aliases (*name); write the "
                                        "values out")
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _LimitError(mark, f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self.depth -= 1


class _LimitedLoader(_Limits, yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser,
                     yaml.composer.Composer, CoreResolver):
    """PyYAML's Python reader and parser, the limited composer, the core-schema resolver."""

    def __init__(self, stream: str):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        CoreResolver.__init__(self)


if getattr(yaml, "__with_libyaml__", False):
    class _LimitedCLoader(_Limits, yaml.composer.Composer, yaml.cyaml.CParser, CoreResolver):
        """`_LimitedLoader` reading its events from libyaml's parser (the text scanned in C,
        about 10x faster on a cluster of thousands of node groups); the nodes are composed
        and limited by the same Python composer."""

        def __init__(self, stream: str):
            yaml.cyaml.CParser.__init__(self, stream)
            yaml.composer.Composer.__init__(self)
            CoreResolver.__init__(self)
else:  # PyYAML built without libyaml
    _LimitedCLoader = _LimitedLoader  # type: ignore[misc,assignment]


class _LimitError(Exception):
    def __init__(self, mark: Any, message: str):
        super().__init__(message)
        self.mark = mark


def compose_limited(text: str, source: str) -> yaml.Node | None:
    """YAML text -> node tree, within MAX_DEPTH and MAX_ALIASES; ScenarioError otherwise."""
    try:
        try:
            return yaml.compose(text, Loader=_LimitedCLoader)
        except yaml.YAMLError:  # libyaml words problems and its own limits differently:
            return yaml.compose(text, Loader=_LimitedLoader)  # the Python parser's verdict
    except _LimitError as exc:
        raise ScenarioError(f"{source}:{exc.mark.line + 1}: {exc}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow, e.g. NUL
        line = text.count("\n", 0, exc.position) + 1
        raise ScenarioError(f"{source}:{line}: the character U+{exc.character:04X} is not "
                            "allowed in YAML; remove it (is this a text file?)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ScenarioError(f"{where}: malformed YAML: {problem}; fix the syntax "
                            "(indentation, a missing ':' or an unclosed bracket)") from None
