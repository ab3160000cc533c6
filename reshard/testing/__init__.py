"""Helpers for testing reshard and code built on it: hypothesis strategies of models and topologies, and
independent checks of plans. Imports hypothesis; not imported by `import reshard`."""
