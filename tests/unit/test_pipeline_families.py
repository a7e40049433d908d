"""`PIPELINE_FAMILIES`, the model types `--pipeline-parallel` accepts (and docs/operations.md
names), are the ones whose mlx-lm model can pipeline: each holds a `PipelineMixin` model (or
wraps a listed family's model), and every mlx-lm module that defines one is listed, so an mlx-lm
upgrade that adds or drops one shows here."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path
from types import ModuleType

import mlx_lm.models
from mlx_lm.models.pipeline import PipelineMixin

from adapters.mlx.loading import PIPELINE_FAMILIES, pipeline_refusal

DOC = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    except (ImportError, SystemExit):  # olmo exits when its optional package is missing
        return None


def _pipelines(module: ModuleType, *, defined_here: bool) -> bool:
    """The module holds a `PipelineMixin` model (its own, or with `defined_here` False an imported one)."""
    return any(inspect.isclass(value) and issubclass(value, PipelineMixin) and value is not PipelineMixin
               and (not defined_here or value.__module__ == module.__name__)
               for value in vars(module).values())


def test_every_listed_family_pipelines() -> None:
    for name in PIPELINE_FAMILIES:
        module = _module(name)
        assert module is not None, name
        wrapped = [other for other in PIPELINE_FAMILIES if other != name
                   and issubclass(module.Model, importlib.import_module(f"mlx_lm.models.{other}").Model)]
        assert _pipelines(module, defined_here=False) or wrapped, name
        assert f"`{name}`" in DOC, f"docs/operations.md does not name {name}"


def test_every_family_mlx_lm_pipelines_is_listed() -> None:
    found = {info.name for info in pkgutil.iter_modules(mlx_lm.models.__path__)
             if info.name not in ("pipeline", "olmo")
             and (module := _module(info.name)) is not None and _pipelines(module, defined_here=True)}
    # kimi_vl's Model has no `model` for mlx-lm to pipeline (it holds its DeepseekV3Model deeper).
    assert found - {"kimi_vl"} <= set(PIPELINE_FAMILIES), sorted(found - set(PIPELINE_FAMILIES))


def test_other_families_are_refused_naming_those_that_pipeline() -> None:
    assert pipeline_refusal("qwen3_next", 2) is None
    refusal = pipeline_refusal("llama", 2)
    assert refusal is not None and "'llama'" in refusal and "qwen3_next" in refusal
