"""Trace simulation: the project's own cache code replayed over a request trace with a virtual
clock (``hicache simulate``; see docs/simulation.md)."""
