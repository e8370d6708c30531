"""The command-line interface: one thin module per command, one renderer."""
