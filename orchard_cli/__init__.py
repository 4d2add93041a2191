"""The `orchard` command line: Typer + Rich over the orchard_env, provision and images libraries."""
