"""absl command-line entry points (`deepinfer-jax SUBCOMMAND [flags]`).

Each subcommand lives in its own module, imported only when it is invoked, and is registered in
`deepinfer_jax.cli.main` by the issue that implements it.
"""
