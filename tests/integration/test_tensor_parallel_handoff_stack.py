"""Two tensor-parallel workers (two gloo ranks each) hand a prompt off through the stack:
real NATS, router, KV transfer; the engine-level cases are in
test_tensor_parallel_handoff.py, whose tiny model and settings this reuses."""

from __future__ import annotations

import pytest
import torch
from moe_checkpoints import save_hf_folder
from test_tensor_parallel_handoff import ENGINE, PARAMS, PROMPTS, _llama
from worker_client import Heartbeats, Request, connect, wait_disaggregated

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.services.launch.stack import StackConfig
from tokenyard.v1 import serving_pb2 as pb

# Two workers of two processes each, and the stack, on a CPU other suites share.
# On cuda (TOKENYARD_TEST_DEVICE, as the engine-level file) both workers share two GPUs.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        ENGINE["device"] != "cpu" and torch.cuda.device_count() < 2, reason="tp=2 needs 2 GPUs"
    ),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(save_hf_folder(_llama(), tmp_path_factory.mktemp("llama-tp-stack")))


async def test_two_tensor_parallel_workers_hand_off_through_the_stack(folder, launch_stack):
    """A prefill worker and a decode worker of two ranks each, real NATS and router: the
    decode worker pulls the prompt's KV (staged whole-head on both sides), never
    recomputes it, and answers one rank's greedy tokens."""
    config = StackConfig(
        prefill=0,
        decode=0,
        model=folder,
        gateway=False,
        kvcache=False,
        facilities=False,
        tensor_parallel_size=2,
        device=ENGINE["device"],
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        worker_env={
            "TOKENYARD_WORKER_KV_CACHE_BYTES": str(2 << 20),
            "TOKENYARD_WORKER_NUM_THREADS": "1",
        },
    )
    with launch_stack(config) as stack:
        stack.add_worker("prefill", worker_id="prefill-tp2")
        stack.add_worker("decode", worker_id="decode-tp2")
        bus = await connect(stack.nats_url)
        beats = await Heartbeats().start(bus)
        assert await beats.wait_for(lambda b: {"prefill-tp2", "decode-tp2"} <= set(b), 240), (
            stack.describe_failures()
        )
        assert beats.latest["prefill-tp2"].kv_endpoint  # a tp=2 worker serves hand-offs
        prompt = PROMPTS[1]
        await wait_disaggregated(bus, prompt)
        params = pb.SamplingParams(
            max_tokens=PARAMS.max_tokens, temperature=0.0, top_p=1.0, ignore_eos=True
        )
        req = Request(bus, prompt, params)
        assert (await req.submit()).placement.disaggregated
        result = await req.wait(120)
        await bus.close()
        log = (stack.log_dir / "decode-tp2.log").read_text()
    assert result.chunks[0].worker_id == "prefill-tp2" and result.last.worker_id == "decode-tp2"
    assert f"KV pull {req.rid}: {-(-len(prompt) // 16)} blocks" in log, log[-3000:]
    assert f"KV pull {req.rid} from" not in log  # the failure line ("... failed; recomputing")
    plain = LLMEngine(EngineConfig(model=folder, enable_prefix_caching=False, **ENGINE))
    plain.add_request("offline", prompt, PARAMS)
    offline = plain.seqs["offline"]
    while plain.has_unfinished():
        plain.step()
    assert result.token_ids == offline.output_token_ids
