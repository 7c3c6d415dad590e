"""OpenAI's Responses API: routes, the per-tenant store of kept responses, retrieval and stream events.
"""
