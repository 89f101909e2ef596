"""`fitlm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over batched decoding.

model.py loads MODEL (+ adapter), tokenizer and chat template; protocol.py validates requests and
shapes OpenAI's JSON; engine.py runs the decode loop in a background thread (fitlm/infer/batched.py);
stops.py turns tokens into text deltas with stop strings; app.py is the ASGI app; cli.py the command.
"""
