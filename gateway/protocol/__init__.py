"""Wire formats: OpenAI's chat-completions, legacy completions and Responses requests and output
items, Anthropic's Messages, and the typed answer every API renders (answer.py). Pure data and
validation: no torch, no engine.
"""
