"""Ray scale-out for the planner and sweeps (anything that maps a function over chunks).

`ray_map(fn, context, options, chunks, address)` runs `fn(context, options, chunk)` for every
chunk as a Ray task and returns the results in chunk order, so a Ray run ranks exactly as a local
one. `address` is "auto" (a running cluster found by Ray, else a local instance started for the
call) or a cluster address ("host:6379" for the GCS, "ray://host:10001" for Ray Client). Before
Ray is asked, an explicit address is checked to be well formed and to accept a TCP connection, so
a typo or a stopped cluster is a clear error in seconds (Ray itself retries for minutes). Ray is
an optional dependency.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from holmes_sim.errors import FieldError

CONNECT_TIMEOUT_S = 3.0
"""How long the reachability check waits for a TCP connection to the given address (seconds)."""


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of 'host:port' or 'ray://host:port' ('[v6]:port' too); FieldError otherwise."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or any(c.isspace() or c in "/?#@" for c in host) or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise FieldError("--ray", f"{address!r} is not a Ray address; give 'auto', HOST:PORT (the "
                                  "head's GCS port, 6379 by default) or ray://HOST:PORT (Ray Client, "
                                  "10001 by default)")
    return host, int(port)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """FieldError naming the address unless something accepts TCP connections there."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise FieldError("--ray", f"nothing answers at {host}:{port} ({reason}); start the cluster "
                                  "(`ray start --head` on the head node), check the address, or "
                                  "use --ray auto for a local instance") from None


def _init(ray, address: str) -> None:
    if address == "auto":
        try:
            ray.init(address="auto", log_to_driver=False)
        except (ConnectionError, RuntimeError):
            ray.init(log_to_driver=False)
        return
    ray.init(address=address, log_to_driver=False)


def ray_map(fn: Callable, context, options, chunks: list, address: str,
            progress: Callable[[int, int], None] | None = None, total: int = 0) -> list:
    """Results of `fn(context, options, chunk)` for each chunk, in order (see module docstring).
    `progress(done, total)` counts the items of the chunks that have come back."""
    try:
        import ray
    except ImportError:
        raise FieldError("--ray", "Ray is not installed; pip install 'ray[default]' or drop --ray "
                                  "(the local process pool is the default)") from None
    if address != "auto":
        check_reachable(address)
    started = False
    if not ray.is_initialized():
        try:
            _init(ray, address)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise FieldError("--ray", f"cannot reach the Ray cluster at {address!r}: {exc}") from None
        started = True
    try:
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
    finally:
        if started:
            ray.shutdown()
