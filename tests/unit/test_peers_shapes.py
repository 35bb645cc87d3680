"""benchmarks/peers.py on a model_shapes.py checkpoint: what each server is given, and nothing
changed without --shape / --model-dir."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, str(_PATH.parent))  # peers.py imports model_shapes.py beside it
    spec = importlib.util.spec_from_file_location("peers_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(_PATH.parent))
    for name in (spec.name, "model_shapes", "result_path"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def folder(peers, tmp_path_factory):
    shapes = peers.model_shapes
    shape = dataclasses.replace(
        shapes.SHAPES["qwen2.5-0.5b"], layers=1, hidden=64, intermediate=128, head_dim=16
    )
    out = tmp_path_factory.mktemp("shapes") / "qwen2.5-0.5b"
    return shapes.write_checkpoint(shape, out)


def test_without_a_shape_every_server_gets_the_default_model(peers):
    model = peers.chosen_model(None, None)
    assert model == peers.Model.default()
    assert model.name == peers.MODEL_NAME and model.folder is None
    assert model.gguf.suffix == ".gguf"
    assert model.stack_flags() == model.engine_flags() == []


def test_a_shape_folder_goes_to_every_server(peers, folder):
    model = peers.chosen_model(None, folder)
    assert model.name == "qwen2.5-0.5b"  # the name tokenyard serves a folder under
    assert model.folder == folder.resolve()
    assert model.gguf == peers.model_shapes.gguf_path(folder).resolve()
    assert model.engine_flags() == ["--model", str(folder.resolve())]
    assert model.stack_flags() == [
        *model.engine_flags(),
        "--kv-cache-mib",
        str(peers.SHAPE_KV_CACHE_MIB),
    ]


def test_a_folder_without_a_gguf_is_refused(peers, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="model_shapes.py"):
        peers.Model.from_folder(tmp_path)
