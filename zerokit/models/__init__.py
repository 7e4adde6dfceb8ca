"""Small built-in models for examples, benchmarks and ``zerokit compare``."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
