"""`headroom serve`: an OpenAI-compatible HTTP API over one LLMEngine.

The engine is single-threaded by design (scheduler, KV allocator and policy are not locked), so it runs on
its own thread (`async_engine.AsyncEngine`); the asyncio side (`app.py`) only talks to it through a
command queue and per-request asyncio queues.
"""
