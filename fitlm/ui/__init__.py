"""`fitlm ui`: a local web page to plan, launch, watch, chat with and export runs (FastAPI + the package's assets)."""
