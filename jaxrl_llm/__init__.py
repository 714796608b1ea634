"""jaxrl_llm: JAX-native, functional reinforcement learning for language models."""

__version__ = "0.1.0"
