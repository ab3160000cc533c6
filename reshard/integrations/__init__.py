"""Backends that RL frameworks select through their own extension points (each module imports its framework, if
at all, lazily; none is imported by `import reshard`)."""
