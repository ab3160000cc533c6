"""Backends that RL frameworks select through their own extension points (each module imports its framework
lazily and registers nothing where the framework is absent; none is imported by `import reshard`)."""
