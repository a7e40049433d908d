"""Effects: ports, the interpreter of the core's intents, runners and in-memory fakes.

May import `statecore` and trio; never httpx, mlx or mlx_lm.
"""

__all__: list[str] = []
