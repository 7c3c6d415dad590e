"""Serving: a validated request becomes an engine job (prompt, tool group, grammar, sampling) and the
engine's events become answers; the runtime that builds model, engine and service once; cache admin.
"""
