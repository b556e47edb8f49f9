"""holmes-sim: plan, simulate and validate LLM training on clusters with heterogeneous NICs.

`simulate(scenario, policies=None, seed=None)` is the Python API (see holmes_sim.api). Importing
the package imports nothing heavy (no torch, simpy or matplotlib).
"""

from holmes_sim.api import PolicyResult, Simulation, simulate
from holmes_sim.errors import HolmesError
from holmes_sim.version import __version__

__all__ = ["HolmesError", "PolicyResult", "Simulation", "simulate", "__version__"]
