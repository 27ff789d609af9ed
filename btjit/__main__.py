"""`python -m btjit ...` is the `btjit` command."""
from btjit.cli import main

main()
