"""The runtime client layer: what the offline ``Engine`` and the HTTP app both sit on.

It starts the process group, runs the tokenizer manager (tokenize, validate, send, route
replies) and the watchdog on one asyncio loop, turns a call's prompts into typed jobs, and
streams each request's pieces back, aborting the request when its consumer stops reading.
Nothing here knows HTTP.
"""
