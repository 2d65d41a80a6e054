"""`python -m etdist.bench`: the main command (etdist.bench.main)."""
from .main import main

main()
