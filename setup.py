"""The optional C extension (the estimate's walk, `holmes_sim/estimate/_walk_kernel.c`); everything
else is in pyproject.toml. Without a C compiler the build goes on without it and
`holmes_sim.estimate.walk` runs the same walk in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("holmes_sim.estimate._walk_kernel",
                             ["holmes_sim/estimate/_walk_kernel.c"], optional=True)])
