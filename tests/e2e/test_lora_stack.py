"""LoRA adapters through the real stack: gateway, router, NATS and one aggregated worker
with the real default model. An adapter loaded at start (TOKENYARD_WORKER_LORA_MODULES, what
`tokenyard up --lora` sets) is listed under its base and changes the answer; another loads
at run time through the admin API, serves, and unloads; a malformed adapter is a 400 naming
the missing file, one beyond max_lora_rank a 409 naming the limit, an unknown model a 404."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tokenyard.bus.embedded import free_port
from tokenyard.models.lora_adapter import module_shape
from tokenyard.services.launch.stack import StackConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODULES = ("q_proj", "v_proj", "down_proj")


def write_adapter(folder: Path, config, r: int, seed: int) -> str:
    """A random PEFT-format adapter for the default model (q, v and down of every layer)."""
    folder.mkdir(parents=True)
    settings = {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": list(MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in MODULES:
            i, o = module_shape(config, module)
            block = "mlp" if module == "down_proj" else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, i, generator=generator) / i**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=generator) / r**0.5
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, loaded_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    (root / "broken").mkdir()  # no adapter_config.json
    return {
        "sql": write_adapter(root / "sql", loaded_model.config, 8, 1),
        "poet": write_adapter(root / "poet", loaded_model.config, 4, 2),
        "wide": write_adapter(root / "wide", loaded_model.config, 32, 3),
        "broken": str(root / "broken"),
    }


@pytest.fixture(scope="module")
def stack(launch_stack, adapters):
    config = StackConfig(
        port=free_port(),
        aggregated=True,
        workers=1,
        kvcache=False,
        facilities=False,
        telemetry=False,
        worker_env={
            "TOKENYARD_WORKER_ENABLE_LORA": "1",
            "TOKENYARD_WORKER_LORA_MODULES": json.dumps({"sql": adapters["sql"]}),
            "TOKENYARD_WORKER_MAX_LORAS": "2",
            "TOKENYARD_WORKER_MAX_LORA_RANK": "16",
        },
    )
    with launch_stack(config) as stack:
        stack.wait_ready(timeout=1500)  # a busy shared CPU host
        yield stack


def complete(stack, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8}
    body |= {"temperature": 0, "logprobs": 1}
    return httpx.post(f"{stack.gateway_url}/v1/completions", json=body, timeout=300)


def admin(stack, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.gateway_admin_token}"}
    return httpx.post(f"{stack.gateway_url}/v1/{path}", json=body, headers=headers, timeout=120)


def test_an_adapter_loaded_at_start_is_listed_and_changes_the_answer(stack):
    models = httpx.get(f"{stack.gateway_url}/v1/models").json()["data"]
    cards = {m["id"]: m for m in models}
    assert cards["sql"]["parent"] == stack.model_id
    base, tuned = complete(stack, stack.model_id), complete(stack, "sql")
    assert base.status_code == tuned.status_code == 200, tuned.text
    assert tuned.json()["model"] == "sql"
    base_lps = base.json()["choices"][0]["logprobs"]["token_logprobs"]
    tuned_lps = tuned.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert abs(base_lps[0] - tuned_lps[0]) > 1e-3  # the adapter is applied


def test_load_serve_and_unload_at_run_time(stack, adapters):
    r = admin(stack, "load_lora_adapter", {"lora_name": "poet", "lora_path": adapters["poet"]})
    assert r.status_code == 200, r.text
    assert complete(stack, "poet").status_code == 200
    r = admin(stack, "unload_lora_adapter", {"lora_name": "poet"})
    assert r.status_code == 200, r.text
    r = complete(stack, "poet")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_are_refused_naming_the_problem(stack, adapters):
    r = admin(stack, "load_lora_adapter", {"lora_name": "b", "lora_path": adapters["broken"]})
    assert r.status_code == 400, r.text
    assert "adapter_config.json missing" in r.json()["error"]["message"]
    r = admin(stack, "load_lora_adapter", {"lora_name": "w", "lora_path": adapters["wide"]})
    assert r.status_code == 409, r.text
    assert "rank 32, beyond max_lora_rank 16" in r.json()["error"]["message"]
    r = admin(stack, "unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404
    assert complete(stack, "no-such-model").status_code == 404
