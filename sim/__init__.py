"""sim: a simulated vLLM node (OpenAI API, KV block pool, continuous batching, vLLM metrics).

``kvgate sim`` / ``python -m sim`` start it; ``sim.engine`` is its pure, clock-driven core.
"""
