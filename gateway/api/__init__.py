"""The model app's HTTP API: FastAPI routes for chat completions, Responses, Anthropic Messages,
legacy completions, cache management and the dashboard. Each route hands work to serving and
renders what it gets back.
"""
