"""The benchmarks behind every table in the notebooks: `python -m labkit bench SUB ...`
(`cli.py` dispatches; one module per benchmark, each with a `main(argv)`), and `python -m labkit
eval ppl`. Each compares in alternating turns on one workload and prints ratios."""
