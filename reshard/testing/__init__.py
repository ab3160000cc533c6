"""Public helpers for testing reshard and code built on it: `strategies` (hypothesis), `random_layouts`, `checks`
(reference checks of a plan), `world` (N processes in one world) and `megatron_cpu` (megatron-core on CPU)."""
