"""`fitlm profile`: a short measured training burst under the configured layout, held against the plan.

burst.py runs the steps on every rank and measures; trace.py reads torch.profiler (communication,
memory by operator); compare.py plans the same config and states each engine's error; report.py
writes profile.json and report.md; plots.py the PNG charts; cli.py parses and launches.
"""
