"""Helpers for testing reshard and code built on it: hypothesis strategies of models and topologies, independent
checks of plans, and real megatron-core models on CPU under gloo (`megatron_cpu`). Imports hypothesis; not
imported by `import reshard`; megatron is imported only by `megatron_cpu`'s functions."""
