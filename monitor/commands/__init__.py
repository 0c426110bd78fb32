"""The `torchtop` command and its subcommands."""
