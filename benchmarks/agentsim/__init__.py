"""The closed-loop agent simulator behind ``benchmarks/agents.py`` (the CLI and user docs):
``plan`` draws the seeded workload (``Workload``, ``PRESETS``, ``make_plan``), ``client``
replays it against an OpenAI-compatible endpoint and polls ``/metrics`` (``run_plan``), and
``report`` turns the records into the overflow split, summaries, the comparison table and
the plot.
"""
