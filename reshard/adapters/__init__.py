"""The outside world: megatron-core models, vLLM workers and their weight-transfer API.

The only place that imports megatron, vllm or nixl, always lazily, so `import reshard` stays light.
"""
