"""The subcommands of the `pdc` command line (pdc/cli.py), one module per group."""
