"""The `--hosts` file of `run --plans` and `plan --export`: the real host of each of the
scenario's nodes, one a line in the scenario's node order (`HOST`) or by name (`HOST NODE`), read
into a host per scenario node name, which every plan's launch folder lists in its own node order
(`launch.launch_files`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from holmes_sim.errors import PlanError, ScenarioError
from holmes_sim.spec.limits import read_text_bounded

_HOST_NAME = re.compile(r"[A-Za-z0-9_.:\[\]][A-Za-z0-9_.:\[\]-]*")
"""A host name or address: letters, digits, '.', '-', '_', and ':' '[' ']' for IPv6, not
starting with '-' (no RFC 1123 label does; torchrun would read it as an option)."""


@dataclass(frozen=True, slots=True)
class HostLine:
    """One line of a `--hosts` file: the host, the scenario node it names (None: the line's
    position names it) and the line's number."""

    host: str
    node: str | None
    line: int


def read_host_names(path: Path) -> list[HostLine]:
    """The lines of a hosts file, one scenario node a line: `HOST` (the nodes in the scenario's
    order) or `HOST NODE` (the node by name), every line the one form or every line the other.
    Words with '=' are skipped, so an MPI-style `host slots=8` line works; `#` starts a comment.
    Each host is a host name or address and none is given twice (`launch.sh` gives each host
    the first node of its name).

    Raises:
        PlanError: when the file cannot be read, or a line is not of these forms.
    """
    try:  # a regular UTF-8 file within the loader's size limit (not /dev/zero, not a FIFO)
        text = read_text_bounded(path, "hosts", "give a text file with one host name a line")
    except ScenarioError as exc:
        raise PlanError(f"--hosts {exc}") from None
    hosts: list[HostLine] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        got = _host_line(path, number, words)
        if (same := next((h for h in hosts if _same_host(h.host, got.host)), None)) is not None:
            raise PlanError(f"--hosts {path}:{number}: {got.host!r} is the host of line "
                            f"{same.line} ({same.host!r}) again; every node needs a host of its "
                            "own")
        if hosts and (hosts[0].node is None) != (got.node is None):
            raise PlanError(f"--hosts {path}:{number}: every line names its scenario node "
                            "(HOST NODE) or none does (HOST, in the scenario's node order); "
                            f"line {hosts[0].line} does{'' if hosts[0].node else ' not'}, "
                            f"this one does{'' if got.node else ' not'}: make them agree")
        hosts.append(got)
    return hosts


def _host_line(path: Path, number: int, words: list[str]) -> HostLine:
    """The host and node of one line's `words` (MPI's `slots=N` and the like skipped)."""
    name, nodes = words[0], [w for w in words[1:] if "=" not in w]
    where = f"--hosts {path}:{number}"
    if name.startswith("-"):
        raise PlanError(f"{where}: {name[:40]!r} starts with '-', which no host name does "
                        "(RFC 1123) and torchrun would read as an option; fix the line")
    if not _HOST_NAME.fullmatch(name):
        raise PlanError(f"{where}: {name[:40]!r} is not a host name or address (letters, "
                        "digits, '.', '-', '_', ':'); fix the line")
    if len(nodes) > 1:
        raise PlanError(f"{where}: {' '.join(nodes)[:60]!r} after the host; give HOST, or HOST "
                        "NODE with one of the scenario's node names")
    return HostLine(name, nodes[0] if nodes else None, number)


def _same_host(a: str, b: str) -> bool:
    """Whether two host names name one machine: equal but for case (DNS names are
    case-insensitive, RFC 4343), or one the short form of the other (`h0`, `h0.example.com`),
    which `launch.sh` tells apart only by `hostname -s`. Addresses compare whole."""
    a, b = a.lower(), b.lower()
    if a == b:
        return True
    if _ADDRESS.fullmatch(a) or _ADDRESS.fullmatch(b):
        return False
    return a.split(".", 1)[0] == b.split(".", 1)[0] and ("." not in a or "." not in b)


_ADDRESS = re.compile(r"[0-9.]+|.*:.*")
"""An IPv4 or IPv6 address, whose dotted parts are no short name."""


def read_hosts(path: Path, nodes: list[str], lines: list[HostLine] | None = None
               ) -> dict[str, str]:
    """The host of each scenario node (`nodes`: their names in the scenario's order, as the
    default `hostfile` lists them) from `read_host_names` of `path` (`lines`, when read from it
    already): by line position, or by the node each line names.

    Raises:
        PlanError: as `read_host_names`, when they name other than one host a node, or a
            line names a node the scenario does not have or one another line names.
    """
    lines = read_host_names(path) if lines is None else lines
    if len(lines) != len(nodes):
        shown = ", ".join(nodes[:8]) + (", ..." if len(nodes) > 8 else "")
        raise PlanError(f"--hosts {path}: names {len(lines)} hosts, the plan has {len(nodes)} "
                        f"nodes; list one host a line for each node in the scenario's order "
                        f"({shown}), or `HOST NODE` lines")
    if lines[0].node is None:
        return {node: h.host for node, h in zip(nodes, lines)}
    by_node: dict[str, str] = {}
    for h in lines:
        if h.node not in nodes:
            raise PlanError(f"--hosts {path}:{h.line}: {h.node!r} is not a node of the scenario "
                            f"({', '.join(nodes[:8])}{', ...' if len(nodes) > 8 else ''}); "
                            "fix the node name")
        if h.node in by_node:
            raise PlanError(f"--hosts {path}:{h.line}: node {h.node!r} already has host "
                            f"{by_node[h.node]!r}; give each node one line")
        by_node[h.node] = h.host
    return by_node
