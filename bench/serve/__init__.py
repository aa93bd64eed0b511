"""bench.serve: the whole server under load, side by side (`python -m bench.serve`, make bench-serve).

Pieces (each module's docstring is its design note):
- __main__.py  the command line: duet disaggregated, duet colocated and vLLM CPU by DistServe goodput
- clients.py   vLLM's benchmark client and `duet bench`
- servers.py   one server process per configuration
- report.py    the markdown tables and summary lines
- plots.py     the PNG plots
"""
