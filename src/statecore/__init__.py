"""statecore's pure core: phases, events, intents, transition tables, step functions.

Nothing here performs I/O or imports trio, httpx, mlx or mlx_lm.
"""

__all__: list[str] = []
