"""The optional C extensions (the estimate's walk, `holmes_sim/estimate/_walk_kernel.c`, and the
trace's row packing, `holmes_sim/sim/_trace_rows.c`); everything else is in pyproject.toml.
Without a C compiler the build goes on without them: `holmes_sim.estimate.walk` runs the same
walk in Python and `holmes_sim.sim.trace` packs rows with `struct`."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("holmes_sim.estimate._walk_kernel",
                             ["holmes_sim/estimate/_walk_kernel.c"], optional=True),
                   Extension("holmes_sim.sim._trace_rows",
                             ["holmes_sim/sim/_trace_rows.c"], optional=True),
                   Extension("holmes_sim.sim._run_loop",
                             ["holmes_sim/sim/_run_loop.c"], optional=True)])
