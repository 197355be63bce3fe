"""The OpenAI-compatible HTTP server (`python -m atlas.serve`): starlette routes in app.py, request
parsing in protocol.py, the single engine thread in worker.py."""
