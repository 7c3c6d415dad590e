"""Serving: a validated request becomes an engine job (prompt, tool group, grammar, sampling) and the
engine's events become answers; the runtime that builds model, engine and service once; cache admin.
It owns the grammars (their Lark text, output_grammar.py; the compiled ones, kept per tenant,
grammars.py) and hands the engine a ready matcher per job.
"""
