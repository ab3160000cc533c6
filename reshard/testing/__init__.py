"""Helpers for testing reshard and code built on it (public): `strategies` (hypothesis strategies of models,
topologies and plans), `checks` (reference checks of a plan's coverage and bytes), `world` (run a function on N
processes in one gloo world) and `megatron_cpu` (real megatron-core models on CPU under gloo). Not imported by
`import reshard`; hypothesis is imported only by `strategies`, megatron only by `megatron_cpu`'s functions. The
test suite's own harness (servers, trainer jobs, fault injection) is tests/harness/, not part of the package."""
