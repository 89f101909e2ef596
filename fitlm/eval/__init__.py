"""`fitlm eval`: lm-evaluation-harness tasks on any MODEL, in process (harness.py: fitlm's model as an lm-eval LM)."""
