"""The HTTP edge: what every request passes before any model work (auth and tenants, browser defences,
body and field limits, admission, the uvicorn server, the error handlers). Never imports torch, serving or
the engine; proxy mode runs on it alone.
"""
