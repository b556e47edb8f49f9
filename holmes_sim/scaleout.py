"""Ray scale-out for the planner (and anything else that maps a function over chunks).

`ray_map(fn, prepared, spec, chunks, address)` runs `fn(prepared, spec, chunk)` for every chunk as
a Ray task and returns the results in chunk order, so a Ray run ranks exactly as a local one.
`address` is "auto" (a running cluster found by Ray, else a local instance started for the call)
or a cluster address ("ray://host:10001", "host:6379"). Ray is an optional dependency.
"""

from __future__ import annotations

from collections.abc import Callable

from holmes_sim.errors import FieldError


def ray_map(fn: Callable, prepared, spec, chunks: list, address: str,
            progress: Callable[[int, int], None] | None = None, total: int = 0) -> list:
    """Results of `fn(prepared, spec, chunk)` for each chunk, in order (see module docstring)."""
    try:
        import ray
    except ImportError:
        raise FieldError("--ray", "Ray is not installed; pip install 'ray[default]' or drop --ray "
                                  "(the local process pool is the default)") from None
    started = False
    if not ray.is_initialized():
        try:
            if address == "auto":
                try:
                    ray.init(address="auto", log_to_driver=False)
                except (ConnectionError, RuntimeError):
                    ray.init(log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise FieldError("--ray", f"cannot reach the Ray cluster at {address!r}: {exc}") from None
        started = True
    try:
        remote = ray.remote(fn)
        shared_p, shared_s = ray.put(prepared), ray.put(spec)
        refs = [remote.remote(shared_p, shared_s, chunk) for chunk in chunks]
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
