"""The optional C extensions (the estimate's walk, `holmes_sim/estimate/_walk_kernel.c`, the
trace's row packing, `holmes_sim/sim/_trace_rows.c`, the calendar's bucket loop,
`holmes_sim/sim/_run_loop.c`, the flow network's agenda entries,
`holmes_sim/sim/_agenda_entries.c`, the pipeline messages' send, post and arrival,
`holmes_sim/sim/_pipeline_messages.c`, and an entity's common op,
`holmes_sim/sim/_entity_steps.c`; the engine's C files share headers in `holmes_sim/sim/`:
`_slots.h`, slot reads; `_rows.h`, trace rows; `_lists.h`, list items); everything else is
in pyproject.toml. Without a C compiler the build goes on without them: each module runs the
same work in Python. Each extension is stamped with the SHA-256 of its .c file and the
local headers it includes, its `SOURCE_SHA256`, which `holmes_sim.version.extension` compares
with the sources beside it."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
SLOTS, ROWS, LISTS = (f"holmes_sim/sim/{h}" for h in ("_slots.h", "_rows.h", "_lists.h"))


def _source_digest():
    """`holmes_sim.version.source_digest`, loaded from its file (the package is not built yet)."""
    spec = importlib.util.spec_from_file_location("_holmes_version", HERE / "holmes_sim/version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_digest


def _extension(name: str, source: str, depends: list[str]) -> Extension:
    """The optional extension `name` built from `source`, stamped with the SHA-256 of that file
    and the local headers it includes (`source_digest`)."""
    digest = _source_digest()(HERE / source)
    return Extension(name, [source], depends=depends, optional=True,
                     define_macros=[("SOURCE_SHA256", f'"{digest}"')])


setup(ext_modules=[
    _extension("holmes_sim.estimate._walk_kernel", "holmes_sim/estimate/_walk_kernel.c", []),
    _extension("holmes_sim.sim._trace_rows", "holmes_sim/sim/_trace_rows.c", [ROWS]),
    _extension("holmes_sim.sim._run_loop", "holmes_sim/sim/_run_loop.c", [SLOTS]),
    _extension("holmes_sim.sim._agenda_entries", "holmes_sim/sim/_agenda_entries.c", [SLOTS]),
    _extension("holmes_sim.sim._pipeline_messages", "holmes_sim/sim/_pipeline_messages.c",
               [SLOTS, ROWS, LISTS]),
    _extension("holmes_sim.sim._entity_steps", "holmes_sim/sim/_entity_steps.c",
               [SLOTS, ROWS, LISTS])])
