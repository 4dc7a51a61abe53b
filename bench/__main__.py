"""python -m bench: the compare (bench/compare.py says what it runs and writes)."""
from bench.compare import main

main()
