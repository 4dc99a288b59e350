"""deepinfer_jax: a JAX/XLA inference engine for the DeepSeek model family."""

__version__ = "0.1.0.dev0"
