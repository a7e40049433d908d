"""`--model` as a Hugging Face repo id, resolved offline against a cache this test builds in the
layout huggingface_hub writes (models--owner--name/refs/main -> snapshots/<commit>/files)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

from adapters.model_source import ModelNotFound, looks_like_repo_id, resolve_model
from adapters.serve.flags import demo_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo: str) -> Path:
    """A Hugging Face cache holding `repo` at COMMIT (the demo model's files); its snapshot dir."""
    owner, name = repo.split("/")
    entry = root / f"models--{owner}--{name}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(COMMIT)
    snapshot = entry / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in demo_model_dir().iterdir():
        if file.is_file():
            shutil.copy(file, snapshot / file.name)
    return snapshot


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network exists here; this makes huggingface_hub say so at once instead of timing out."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_cached_repo_id_resolves_to_its_snapshot_without_the_network(tmp_path: Path, offline: None) -> None:
    snapshot = fake_hub_cache(tmp_path, "mlx-community/statecore-demo")
    source = resolve_model("mlx-community/statecore-demo", cache_dir=tmp_path)
    assert source.directory == snapshot
    assert source.served_name == "mlx-community/statecore-demo"
    assert (source.directory / "config.json").is_file()


def test_a_directory_is_used_as_it_is(tmp_path: Path) -> None:
    source = resolve_model(demo_model_dir(), cache_dir=tmp_path)
    assert source.directory == demo_model_dir() and source.served_name is None


def test_a_repo_missing_from_the_cache_offline_is_one_clear_error(tmp_path: Path, offline: None) -> None:
    fake_hub_cache(tmp_path, "mlx-community/statecore-demo")
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache"):
        resolve_model("mlx-community/not-there", cache_dir=tmp_path)


def test_a_missing_path_that_is_no_repo_id_is_named_as_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(tmp_path / "nothing" / "here", cache_dir=tmp_path)


@pytest.mark.parametrize(("given", "repo"), [
    ("mlx-community/Qwen3-0.6B-4bit", True), ("owner/name.v2", True), ("./models/m", False),
    ("/models/m", False), ("a/b/c", False), ("plain", False), ("a--b/c", False),
])
def test_repo_ids_are_told_from_paths(given: str, repo: bool) -> None:
    assert looks_like_repo_id(given) is repo


def test_the_cli_serves_a_cached_repo_under_its_repo_id(tmp_path: Path, offline: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`statecore run --model owner/name` resolves through the same cache (env HF_HUB_CACHE is
    read by huggingface_hub at import, so the test points its constant there)."""
    import argparse

    from adapters.serve.flags import resolve_model_flag

    snapshot = fake_hub_cache(tmp_path, "mlx-community/statecore-demo")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    args = argparse.Namespace(model=Path("mlx-community/statecore-demo"))
    resolve_model_flag(args)
    assert args.model == snapshot
    assert args.served_model_name == "mlx-community/statecore-demo"
    assert str(args.model_given) == "mlx-community/statecore-demo"
    missing = argparse.Namespace(model=Path("mlx-community/absent"))
    with pytest.raises(SystemExit, match=r"^statecore: mlx-community/absent is not in the Hugging Face"):
        resolve_model_flag(missing)
