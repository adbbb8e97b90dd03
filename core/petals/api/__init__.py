"""``petals api``: HTTP APIs in front of a swarm, for applications that do not speak Python.

- ``openai_routes``: the OpenAI API (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``)
- ``chat_api``: the original Petals chat app's API (``POST /api/v1/generate``, WebSocket
  ``/api/v2/generate``), so its existing front-ends connect unchanged
- ``static/index.html``: a chat page at ``/`` streaming from ``/v1/chat/completions``
- ``service``: the one client model behind them, generation in worker threads, streamed to asyncio
- ``text``: decoded text of a growing token sequence, with stop strings across token boundaries
- ``guard``: who may use it: the Host header (against DNS rebinding), the Origin of web pages, the API key
- ``errors``: errors in OpenAI's shape, and the one mapping from a generation's failure to a status
- ``app``: the ASGI application (FastAPI on uvicorn): routes, the guard, body size cap, error handlers

Everything here uses the public client API only (``AutoDistributedModelForCausalLM``,
``inference_session``, ``generate``): one inference session per request or WebSocket connection.
"""
