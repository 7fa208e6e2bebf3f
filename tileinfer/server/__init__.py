"""An OpenAI-compatible HTTP server over one LLM (`tileinfer serve`).

FastAPI and uvicorn are the `serve` extra (pip install tileinfer[serve]); nothing here is imported by
`import tileinfer`.
"""
