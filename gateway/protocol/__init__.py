"""OpenAI wire formats: the chat-completions request and response shapes, and the Responses API's
request and output items. Pure data and validation: no torch, no engine.
"""
