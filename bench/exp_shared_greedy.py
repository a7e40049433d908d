"""Experiment: `statecore` with greedy requests sharing one sampler object in the decode batch.

mlx-lm's `GenerationBatch._step` samples the whole batch with one call when every row's sampler is
the same object, and otherwise slices the log-probabilities row by row, samples each row and
concatenates (about 3 extra graph ops per row per step). `adapters.engine_mlx` gives every request
its own `_PositionSampler`, even greedy ones whose draw does not depend on the position. This
launcher patches that one name (greedy requests get one shared sampler, others are unchanged) and
runs the normal CLI, so bench/side_by_side.py can measure the difference (`--servers
single,single_shared`). Greedy output is unchanged by construction (argmax per row either way).
Not part of the package; the real fix belongs in src/adapters/engine_mlx.py.

    python bench/exp_shared_greedy.py run --role single --model DIR --port N
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from adapters import engine_mlx
from adapters.cli import main

_Original = engine_mlx._PositionSampler
_shared: dict[str, Any] = {}


def _sampler(sampling: Any, seed: int, position: int) -> Any:
    if sampling.greedy:
        if "greedy" not in _shared:
            _shared["greedy"] = _Original(sampling, 0, 0)
        return _shared["greedy"]
    return _Original(sampling, seed, position)


engine_mlx._PositionSampler = _sampler  # type: ignore[misc,assignment]

if __name__ == "__main__":
    raise SystemExit(main())
