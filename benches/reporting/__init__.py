"""What the runner makes of the results: Markdown tables (``markdown``), the machine they were
measured on (``machine``), PNG plots (``plots``), profiles of missed targets (``profiles``) and
the generated ``docs/benchmarks.md`` (``report``)."""
