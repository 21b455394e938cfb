"""The OpenAI-compatible face both daemons serve: the HTTP routes (``http``), the typed requests and
replies (``models``) and the tool calls (``tools``)."""
