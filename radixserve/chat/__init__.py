"""Chat without HTTP: the message schema (``messages``), the chat-template rendering shared by
the chat route, ``/apply_chat_template`` and ``Engine.apply_chat_template`` (``render``), and
the parsers that turn model output into reasoning, content and tool calls (``parsers``)."""
