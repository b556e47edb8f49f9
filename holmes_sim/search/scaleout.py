"""Ray scale-out for the planner and sweeps (anything that maps a function over chunks).

`ray_map(fn, context, options, chunks, address)` runs `fn(context, options, chunk)` for every
chunk as a Ray task and returns the results in chunk order, so a Ray run ranks exactly as a local
one. `address` is "auto" (a running cluster found by Ray, else a local instance started for the
call) or a cluster address ("host:6379" for the GCS, "ray://host:10001" for Ray Client). Before
Ray is asked, an explicit address is checked to be well formed and to answer the gRPC (HTTP/2)
handshake Ray's servers speak, so a typo, a stopped cluster or another service is a clear error in
seconds (Ray itself retries for minutes). Ray is an optional dependency.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable

from holmes_sim.errors import FieldError
from holmes_sim.report.files import deferred_interrupt

CONNECT_TIMEOUT_S = 3.0
"""How long the reachability check waits for a TCP connection to the given address (seconds)."""


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""The HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113, sections 3.4
and 6.5): Ray's GCS and Ray Client speak gRPC, so a Ray peer answers with a SETTINGS frame."""
_SETTINGS_FRAME_TYPE = 4
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
"""A host name label (RFC 1123): ASCII letters, digits and inner hyphens, 1 to 63 characters."""


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of 'host:port' or 'ray://host:port' ('[v6]:port' too), ASCII only;
    FieldError otherwise."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not _valid_host(host, bracketed) or not (port.isascii() and port.isdigit()) \
            or len(port) > 5 or not 0 < int(port) < 65536:
        raise FieldError("--ray", f"{address!r} is not a Ray address; give 'auto', HOST:PORT (the "
                                  "head's GCS port, 6379 by default) or ray://HOST:PORT (Ray Client, "
                                  "10001 by default), in ASCII: a host name of labels of 1 to 63 "
                                  "letters, digits or hyphens, an IPv4 address or [IPv6]")
    return host, int(port)


def check_address(address: str | None) -> None:
    """Parse and probe `address` when it names a cluster (not None or 'auto'), so a bad one
    fails before any work is done."""
    if address not in (None, "auto"):
        check_reachable(address)


def _valid_host(host: str, bracketed: bool) -> bool:
    if not host or not host.isascii():
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return not bracketed and len(host) <= 253 and all(
            _LABEL.fullmatch(label) for label in host.removesuffix(".").split("."))
    return ip.version == 6 or not bracketed


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """FieldError naming the address unless a gRPC (HTTP/2) server, as Ray's GCS and Ray Client
    are, answers there within `timeout_s`."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(HTTP2_PREFACE)
            reply = _read_up_to(sock, 9)
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise FieldError("--ray", f"nothing answers at {host}:{port} ({reason}); start the cluster "
                                  "(`ray start --head` on the head node), check the address, or "
                                  "use --ray auto for a local instance") from None
    if len(reply) < 9 or reply[3] != _SETTINGS_FRAME_TYPE:
        raise FieldError("--ray", f"{host}:{port} answers, but not as a Ray cluster (no gRPC "
                                  "handshake); give the head's GCS port (6379 by default) or its "
                                  "Ray Client port (ray://HOST:10001)")


def _read_up_to(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _init(ray, address: str) -> str | None:
    """Connect to the cluster at `address` ("auto": a running one, else a local instance started
    with a temporary folder of holmes-sim's own, whose path this returns; None otherwise)."""
    if address == "auto":
        try:
            ray.init(address="auto", log_to_driver=False)
            return None
        except (ConnectionError, RuntimeError):
            pass
        temp_dir = tempfile.mkdtemp(prefix="hs-ray-", dir=_temp_parent())
        try:
            ray.init(log_to_driver=False, _temp_dir=temp_dir)
        except BaseException:
            _stop(ray, temp_dir)
            raise
        return temp_dir
    ray.init(address=address, log_to_driver=False)
    return None


def _temp_parent() -> str:
    """The folder Ray would put its own in: `RAY_TMPDIR`, else /tmp on macOS (whose long
    `TMPDIR` makes socket paths too long), else the system's temporary folder."""
    if os.environ.get("RAY_TMPDIR"):
        return os.environ["RAY_TMPDIR"]
    return "/tmp" if sys.platform == "darwin" else tempfile.gettempdir()


def _stop(ray, temp_dir: str | None) -> None:
    """Disconnect (stopping a local instance this started) and remove its temporary folder,
    holding back Ctrl-C (and SIGTERM, SIGHUP) until both are done."""
    with deferred_interrupt():
        try:
            ray.shutdown()
        finally:
            if temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)


def ray_map(fn: Callable, context, options, chunks: list, address: str,
            progress: Callable[[int, int], None] | None = None, total: int = 0) -> list:
    """Results of `fn(context, options, chunk)` for each chunk, in order (see module docstring).
    `progress(done, total)` counts the items of the chunks that have come back. A connection
    this opens is closed however the call ends, a Ctrl-C during `ray.init` included (held back
    until the connection is made, then raised): a local instance it started is stopped and its
    temporary folder removed; a cluster it connected to keeps its files."""
    try:
        import ray
    except ImportError:
        raise FieldError("--ray", "Ray is not installed; pip install 'ray[default]' or drop --ray "
                                  "(the local process pool is the default)") from None
    if address != "auto":
        check_reachable(address)
    if ray.is_initialized():  # the caller's connection, left open
        return _map(ray, fn, context, options, chunks, progress, total)
    temp_dir = None
    try:
        with deferred_interrupt():  # a Ray half started cannot be stopped: let ray.init finish
            try:
                temp_dir = _init(ray, address)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise FieldError("--ray", f"cannot reach the Ray cluster at {address!r}: "
                                          f"{exc}") from None
            except OSError as exc:  # e.g. a socket path past AF_UNIX's 107 bytes
                raise FieldError("--ray", f"cannot start a local Ray instance: {exc}; set "
                                          "RAY_TMPDIR to a shorter folder (Ray's socket paths "
                                          "under it must fit in 107 bytes)") from None
        return _map(ray, fn, context, options, chunks, progress, total)
    finally:
        _stop(ray, temp_dir)


def _map(ray, fn: Callable, context, options, chunks: list,
         progress: Callable[[int, int], None] | None, total: int) -> list:
    remote = ray.remote(fn)
    shared_context, shared_options = ray.put(context), ray.put(options)
    refs = [remote.remote(shared_context, shared_options, chunk) for chunk in chunks]
    out, done = [], 0
    for chunk, ref in zip(chunks, refs, strict=True):
        out.append(ray.get(ref))
        done += len(chunk)
        if progress:
            progress(done, total)
    return out
