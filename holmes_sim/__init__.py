"""holmes-sim: plan, simulate and validate LLM training on clusters with heterogeneous NICs.

Importing the package imports nothing heavy (no torch, simpy or matplotlib).
"""

__version__ = "0.1.0"
