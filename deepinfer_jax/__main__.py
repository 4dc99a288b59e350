"""`python -m deepinfer_jax ...`: the same command line as the `deepinfer-jax` console script."""

from deepinfer_jax.cli.main import run

if __name__ == "__main__":
    run()
