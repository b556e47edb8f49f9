"""The optional C extensions (the estimate's walk, `holmes_sim/estimate/_walk_kernel.c`, the
trace's row packing, `holmes_sim/sim/_trace_rows.c`, the calendar's bucket loop,
`holmes_sim/sim/_run_loop.c`, the flow network's agenda entries,
`holmes_sim/sim/_agenda_entries.c`, the pipeline messages' send, post and arrival,
`holmes_sim/sim/_pipeline_messages.c`, and an entity's common op,
`holmes_sim/sim/_entity_steps.c`; the engine's C files share headers in `holmes_sim/sim/`:
`_slots.h`, slot reads; `_rows.h`, trace rows; `_lists.h`, list items); everything else is
in pyproject.toml. Without a C compiler the build goes on without them: each module runs the
same work in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("holmes_sim.estimate._walk_kernel",
                             ["holmes_sim/estimate/_walk_kernel.c"], optional=True),
                   Extension("holmes_sim.sim._trace_rows",
                             ["holmes_sim/sim/_trace_rows.c"],
                             depends=["holmes_sim/sim/_rows.h"], optional=True),
                   Extension("holmes_sim.sim._run_loop",
                             ["holmes_sim/sim/_run_loop.c"],
                             depends=["holmes_sim/sim/_slots.h"], optional=True),
                   Extension("holmes_sim.sim._agenda_entries",
                             ["holmes_sim/sim/_agenda_entries.c"],
                             depends=["holmes_sim/sim/_slots.h"], optional=True),
                   Extension("holmes_sim.sim._pipeline_messages",
                             ["holmes_sim/sim/_pipeline_messages.c"],
                             depends=["holmes_sim/sim/_slots.h", "holmes_sim/sim/_rows.h",
                                      "holmes_sim/sim/_lists.h"], optional=True),
                   Extension("holmes_sim.sim._entity_steps",
                             ["holmes_sim/sim/_entity_steps.c"],
                             depends=["holmes_sim/sim/_slots.h", "holmes_sim/sim/_rows.h",
                                      "holmes_sim/sim/_lists.h"], optional=True)])
