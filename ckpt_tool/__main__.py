"""`python -m ckpt_tool` is the `ckpt` command."""
from .cli.main import main

main()
