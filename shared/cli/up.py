"""`tokenyard up`: the whole stack on this machine, each service its own process.

An embedded nats-server (JetStream, temporary directory), the router, prefill and decode
workers, the gateway, and the KV-cache and facilities services unless told not to. Ctrl-C (or
SIGTERM) stops everything; children also die with this process (PR_SET_PDEATHSIG). Before
anything starts, the model, the ports and the options are checked (services/launch/
preflight.py): a problem is one line on stderr and exit code 2. A service that crashes is
restarted with backoff (services/launch/supervise.py); one that keeps failing right after its
start, or exits as misconfigured, stops the stack with one line naming its log.

NOTE: the library imports no service at import time (services build on the library), so the
launcher (tokenyard.services.launch) is imported inside the functions that use it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenyard.bus.auth import redact
from tokenyard.cli import running
from tokenyard.cli.keys import default_keys_url
from tokenyard.engine.config import auto_dtype, kv_cache_dtype_for
from tokenyard.engine.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from tokenyard.autoscale.policy import Decision, Signals
    from tokenyard.services.launch.autoscaler import StackAutoscaler
    from tokenyard.services.launch.config import WorkerParallel
    from tokenyard.services.launch.stack import LocalStack, StackConfig

# Below this many cores a CPU host runs one aggregated worker unless a split is asked for: two
# workers cannot lend each other a core (measured on 2 cores only: docs/benchmarks.md, peers).
DISAGGREGATE_FROM_CORES = 4


def aggregated_by_default(device: str, cores: int) -> bool:
    return device == "cpu" and cores < DISAGGREGATE_FROM_CORES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenyard.services.telemetry.settings import DEFAULT_PORT as TELEMETRY_PORT

    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    parser.add_argument(
        "--prefill", type=int, metavar="N", help="prefill workers (default 1; implies a split)"
    )
    parser.add_argument(
        "--decode", type=int, metavar="M", help="decode workers (default 1; implies a split)"
    )
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument(
        "--aggregated", action="store_true", help="one worker runs prefill and decode"
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="aggregated workers, each running prefill and decode (default 1; implies "
        "--aggregated)",
    )
    parser.add_argument(
        "--router-placement",
        choices=["kv-aware", "round-robin"],
        default="kv-aware",
        help="how the router picks a prompt's worker (default kv-aware: prefix overlap and "
        "load; round-robin: in turn, a baseline to measure it against)",
    )
    layout.add_argument(
        "--disaggregated",
        action="store_true",
        help="prefill and decode workers (the default on a GPU or a CPU host of "
        f"{DISAGGREGATE_FROM_CORES} cores or more; below that one aggregated worker, "
        "which measured faster on 2 cores at low and medium load)",
    )
    parser.add_argument(
        "--model", help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="how the model writes tool calls, by vLLM's names: hermes (Qwen2.5 too; also "
        "'qwen'), llama3_json, mistral (default: the family the chat template writes, "
        "hermes when it names none)",
    )
    parser.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="split the model's thinking into reasoning_content: deepseek_r1, qwen3, granite, "
        "or generic:<open>,<close> (default: none, the thinking stays in the content)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="worker weights and activations (default auto: bfloat16 on a GPU or a CPU with "
        "native bf16 (AVX512-BF16, AMX); float32 on other CPUs, where it is 2x bf16's "
        "throughput at 32 concurrent requests)",
    )
    parser.add_argument(
        "--quantization",
        choices=["int4", "int8", "fp8", "none"],
        help="weight-only quantization for small decode batches (default on a CPU int4: the "
        "default model's own Q4_1 weights, 2.5x bf16's single-stream decode speed; on a GPU "
        "none, the only choice there so far)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where workers run the model (cuda: worker k takes GPU k modulo the GPU count)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        default="1",
        metavar="N|ROLE:N,...",
        help="split each worker's model over N ranks (processes; on cuda N GPUs per worker, "
        "best over NVLink). The model's query and KV heads must divide by N; a worker with "
        "N > 1 hands no KV to others (its decode peers recompute), so pair it with "
        "--aggregated. Per role: prefill:1,decode:2 (roles prefill, decode, both; a bare N "
        "in the list sets the others)",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        default="1",
        metavar="N|ROLE:N,...",
        help="split each worker's layers into N stages, each of --tensor-parallel-size "
        "ranks (tp x N processes; on cuda as many GPUs per worker); N at most the model's "
        "layers. Per role as for --tensor-parallel-size",
    )
    parser.add_argument(
        "--expert-parallel-size",
        default="1",
        metavar="N|ROLE:N,...",
        help="place a Mixture-of-Experts model's experts over N ranks per worker (tokens go "
        "to their experts' ranks by all-to-all); N is 1 or the worker's ranks: with "
        "--tensor-parallel-size N attention is split over the same ranks, with 1 each rank "
        "runs it whole. Unquantized weights only (the CPU default becomes --quantization "
        "none). Per role as for --tensor-parallel-size",
    )
    parser.add_argument(
        "--expert-redundant-slots",
        type=int,
        default=0,
        metavar="N",
        help="with --expert-parallel-size: spare expert slots per rank that the placement "
        "balancer fills with replicas of the hottest experts",
    )
    parser.add_argument(
        "--expert-rebalance-interval",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --expert-parallel-size: recompute the experts' placement from the tokens "
        "each took every STEPS engine steps, moving and replicating experts without a "
        "restart (0 = never)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="on cuda: the share of its GPU each worker may use; workers sharing a GPU split it",
    )
    parser.add_argument(
        "--cpu-memory-utilization",
        type=float,
        metavar="F",
        help="on cpu: the share of this host's memory (its cgroup's limit, in a container) "
        "the workers may use for weights, activations and KV pools, split between them; "
        "each worker's KV pool takes what its weights and activations leave of its part, and "
        "a worker whose model does not fit refuses to start (default: no budget, a "
        "--kv-cache-mib pool)",
    )
    parser.add_argument(
        "--speculative",
        metavar="JSON",
        help="speculative decoding on the decode workers, vLLM's speculative_config: "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft", "model": null, "quantization": "int4"}\' (a self-draft needs '
        "--quantization none)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter in folder PATH as model NAME on every worker "
        "(repeatable); more load at run time through POST /v1/load_lora_adapter with the "
        "gateway's admin token (docs/lora.md)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="keep LoRA slots ready for run-time loads, without any --lora at start",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=4,
        metavar="N",
        help="LoRA adapters a worker's batch mixes at once (its slots; default 4)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        metavar="R",
        help="the largest LoRA rank a worker accepts (default 16)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant workers: a request gets the same tokens whatever else runs "
        "beside it, at a cost in speed (docs/precision.md; needs int4 or int8)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "fp8"],
        help="the workers' KV pool (default auto: float16 beside float32 compute on a CPU, "
        "half the bytes for decode attention to read; else the compute dtype; fp8: e4m3 "
        "beside bfloat16 or float32 on a CPU, see docs/precision.md)",
    )
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        help="KV pool per worker, over any --cpu-memory-utilization or "
        "--gpu-memory-utilization budget (default on cpu without a budget: 256 MiB with "
        "2-byte KV, 512 with float32 KV, 11,000 tokens of the default model)",
    )
    parser.add_argument(
        "--nats-url", help="use this NATS (with JetStream) instead of an embedded one"
    )
    parser.add_argument(
        "--no-kvcache", action="store_true", help="do not start the KV-cache service"
    )
    parser.add_argument(
        "--kvcache-mib",
        type=int,
        default=256,
        help="the KV-cache service's RAM tier in MiB (default 256; resident as blocks arrive)",
    )
    parser.add_argument(
        "--kv-disk-dir",
        default="",
        help="give the KV-cache service a disk tier in this directory; a restart with the"
        " same directory keeps the cached blocks (default: RAM only)",
    )
    parser.add_argument(
        "--kv-disk-gb",
        type=float,
        default=10.0,
        help="the disk tier's size in GiB (default 10; with --kv-disk-dir)",
    )
    parser.add_argument(
        "--no-shared-weights",
        action="store_true",
        help="each CPU worker keeps its own copy of the weights instead of sharing one "
        "read-only copy through /dev/shm",
    )
    parser.add_argument(
        "--no-facilities", action="store_true", help="do not start the facilities service"
    )
    parser.add_argument(
        "--no-telemetry", action="store_true", help="do not start the telemetry service (console)"
    )
    parser.add_argument(
        "--console-port",
        type=int,
        default=TELEMETRY_PORT,
        help=f"the ops console's port (default {TELEMETRY_PORT}; 0 = any free port)",
    )
    parser.add_argument(
        "--log-dir", type=Path, help="keep service logs here (default: a temporary dir)"
    )
    parser.add_argument(
        "--require-keys",
        action="store_true",
        help="the gateway takes only API keys made with `tokenyard keys create` "
        "(per-key limits counted in a private Redis)",
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to wait for the workers"
    )
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help="start and drain prefill and decode workers with the load (docs/autoscaling.md); "
        "a split layout, each pool between --min-workers and --max-workers",
    )
    parser.add_argument(
        "--min-workers",
        type=int,
        default=1,
        metavar="N",
        help="with --autoscale: the fewest workers of each role",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=4,
        metavar="M",
        help="with --autoscale: the most workers of each role",
    )
    parser.add_argument(
        "--slo-ttft-s",
        type=float,
        default=2.0,
        metavar="S",
        help="with --autoscale: the TTFT p99 target; a miss adds a prefill worker",
    )
    parser.add_argument(
        "--slo-itl-s",
        type=float,
        default=0.1,
        metavar="S",
        help="with --autoscale: the ITL p99 target; a miss adds a decode worker",
    )


def config_from(args: argparse.Namespace) -> StackConfig:
    from tokenyard.services.launch.stack import StackConfig

    if (args.prefill is not None and args.prefill < 1) or (args.decode or 0) < 0:
        raise SystemExit("--prefill must be at least 1 and --decode at least 0")
    if args.workers is not None and (
        args.workers < 1 or args.disaggregated or args.prefill is not None or args.decode
    ):
        raise SystemExit("--workers takes 1 or more, and no --prefill, --decode or --disaggregated")
    if args.kvcache_mib < 1 or (args.kv_cache_mib is not None and args.kv_cache_mib < 1):
        raise SystemExit("--kvcache-mib and --kv-cache-mib must be at least 1")
    if args.kv_disk_dir and (args.no_kvcache or args.kv_disk_gb <= 0):
        raise SystemExit("--kv-disk-dir needs the KV-cache service and a --kv-disk-gb above 0")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise SystemExit("--gpu-memory-utilization must be above 0 and at most 1")
    if args.cpu_memory_utilization is not None:
        if not 0 < args.cpu_memory_utilization <= 1:
            raise SystemExit("--cpu-memory-utilization must be above 0 and at most 1")
        if args.device != "cpu":
            raise SystemExit(
                "--cpu-memory-utilization is for --device cpu; on cuda use --gpu-memory-utilization"
            )
    if args.ready_timeout <= 0:
        raise SystemExit("--ready-timeout must be above 0 seconds")
    if args.autoscale and (args.workers is not None or args.aggregated):
        raise SystemExit("--autoscale scales prefill and decode pools: drop --workers/--aggregated")
    if args.autoscale and not 1 <= args.min_workers <= args.max_workers:
        raise SystemExit("--autoscale needs 1 <= --min-workers <= --max-workers")
    if args.slo_ttft_s <= 0 or args.slo_itl_s <= 0:
        raise SystemExit("--slo-ttft-s and --slo-itl-s must be above 0")
    speculative = {}
    if args.speculative:
        try:
            spec = SpeculativeConfig.parse(args.speculative)
        except ValueError as exc:
            raise SystemExit(f"--speculative: {exc}") from exc
        if spec.method == "draft" and spec.model is None and args.quantization != "none":
            raise SystemExit(
                "--speculative: a self-draft (model null) drafts with an int4 copy of the "
                "target, so the target must not be quantized: add --quantization none"
            )
        speculative = {"TOKENYARD_WORKER_SPECULATIVE": args.speculative}
    quantization = _quantization(args)
    if args.deterministic and quantization not in ("int4", "int8"):
        raise SystemExit("--deterministic needs --quantization int4 or int8")
    tp, pp, ep = _parallel_sizes(args)
    if args.speculative and max(tp.values()) * max(pp.values()) > 1:
        raise SystemExit(
            "--speculative runs on one rank only: drop it or --tensor-parallel-size and "
            "--pipeline-parallel-size"
        )
    expert_parallel = _expert_parallel_env(args, quantization, tp, pp, ep)
    gateway_env = _parsers_env(args)
    dtype = auto_dtype(args.device) if args.dtype == "auto" else args.dtype
    try:
        kv_dtype = kv_cache_dtype_for(args.kv_cache_dtype, dtype, args.device)
    except ValueError as exc:
        raise SystemExit(f"--kv-cache-dtype: {exc}") from exc
    return StackConfig(
        port=args.port,
        host=args.host,
        prefill=(args.min_workers if args.autoscale else 1)
        if args.prefill is None
        else args.prefill,
        decode=(args.min_workers if args.autoscale else 1) if args.decode is None else args.decode,
        aggregated=False if args.autoscale else _aggregated(args),
        workers=args.workers or 1,
        router_env={"TOKENYARD_ROUTER_PLACEMENT": args.router_placement},
        gateway_env=gateway_env,
        nats_url=args.nats_url,
        model=args.model,
        kvcache=not args.no_kvcache,
        kvcache_ram_mib=args.kvcache_mib,
        kvcache_disk_dir=str(Path(args.kv_disk_dir).resolve()) if args.kv_disk_dir else "",
        kvcache_disk_gib=args.kv_disk_gb,
        shared_weights=not args.no_shared_weights,
        facilities=not args.no_facilities,
        telemetry=not args.no_telemetry,
        console_port=args.console_port or None,
        log_dir=args.log_dir,
        keys_db_url=default_keys_url() if args.require_keys else None,
        worker_env={
            "TOKENYARD_WORKER_DTYPE": dtype,
            "TOKENYARD_WORKER_KV_CACHE_DTYPE": kv_dtype,
            **_kv_cache_env(args, kv_dtype),
            **_quantization_env(args),
            **speculative,
            **_lora_env(args),
            **expert_parallel,
            **({"TOKENYARD_WORKER_DETERMINISTIC": "1"} if args.deterministic else {}),
        },
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_memory_utilization=args.cpu_memory_utilization,
        tensor_parallel_size=tp[""],
        pipeline_parallel_size=pp[""],
        role_parallel=_role_parallel(tp, pp, ep),
        expert_parallel_size=ep[""],
    )


ROLES = ("prefill", "decode", "both")


def role_sizes(text: str, flag: str) -> dict[str, int]:
    """`N` or `ROLE:N,...` (a bare N in the list sets every role not named) -> {"": the
    default, role: its size for each role named}; SystemExit with the fix on bad input."""
    sizes = {"": 1}
    for item in text.split(","):
        role, _, number = item.strip().rpartition(":")
        if role and role not in ROLES:
            raise SystemExit(
                f"{flag}: unknown role {role!r} in {text!r} (roles: {', '.join(ROLES)})"
            )
        if not number.isdigit() or int(number) < 1:
            raise SystemExit(f"{flag} must be at least 1, as N or ROLE:N,...; got {text!r}")
        sizes[role] = int(number)
    return sizes


def _parallel_sizes(
    args: argparse.Namespace,
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """--tensor-, --pipeline- and --expert-parallel-size, each parsed by role_sizes."""
    return (
        role_sizes(args.tensor_parallel_size, "--tensor-parallel-size"),
        role_sizes(args.pipeline_parallel_size, "--pipeline-parallel-size"),
        role_sizes(args.expert_parallel_size, "--expert-parallel-size"),
    )


def _role_parallel(
    tp: dict[str, int], pp: dict[str, int], ep: dict[str, int]
) -> dict[str, WorkerParallel]:
    """The roles named in any of the flags, each with its three sizes."""
    from tokenyard.services.launch.config import WorkerParallel

    named = sorted((tp.keys() | pp.keys() | ep.keys()) - {""})
    return {
        r: WorkerParallel(tp.get(r, tp[""]), pp.get(r, pp[""]), ep.get(r, ep[""])) for r in named
    }


def _lora_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' LoRA settings: --lora NAME=PATH pairs, checked for shape here (the
    workers check the adapters themselves, and refuse to start on a bad one)."""
    if not args.lora and not args.enable_lora:
        return {}
    if any(max(sizes.values()) > 1 for sizes in _parallel_sizes(args)):
        raise SystemExit(
            "--lora runs on one rank only: drop it or --tensor-parallel-size, "
            "--pipeline-parallel-size and --expert-parallel-size"
        )
    if args.max_loras < 1 or args.max_lora_rank < 1:
        raise SystemExit("--max-loras and --max-lora-rank must be at least 1")
    modules: dict[str, str] = {}
    for pair in args.lora:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora {pair!r}: write NAME=PATH")
        if name in modules:
            raise SystemExit(f"--lora: the name {name!r} is given twice")
        if not Path(path).is_dir():
            raise SystemExit(f"--lora {name}: {path} is not a folder")
        modules[name] = str(Path(path).resolve())
    return {
        "TOKENYARD_WORKER_ENABLE_LORA": "1",
        "TOKENYARD_WORKER_LORA_MODULES": json.dumps(modules),
        "TOKENYARD_WORKER_MAX_LORAS": str(args.max_loras),
        "TOKENYARD_WORKER_MAX_LORA_RANK": str(args.max_lora_rank),
        "TOKENYARD_WORKER_MAX_CPU_LORAS": str(max(32, args.max_loras, len(modules))),
    }


def _expert_parallel_env(
    args: argparse.Namespace,
    quantization: str,
    tp: dict[str, int],
    pp: dict[str, int],
    ep: dict[str, int],
) -> dict[str, str]:
    """The expert-placement balancer's settings for the workers; a layout the engine
    refuses (EngineConfig._check_expert_parallel) stops here, before anything starts."""
    if args.expert_redundant_slots < 0 or args.expert_rebalance_interval < 0:
        raise SystemExit("--expert-redundant-slots and --expert-rebalance-interval must be >= 0")
    if max(ep.values()) == 1:
        return {}
    for role in ("", *ROLES):
        _check_role_expert_parallel(
            role, tp.get(role, tp[""]), pp.get(role, pp[""]), ep.get(role, ep[""])
        )
    if quantization != "none" or args.speculative:
        raise SystemExit("--expert-parallel-size runs unquantized, without --speculative")
    return {
        "TOKENYARD_WORKER_EXPERT_REDUNDANT_SLOTS": str(args.expert_redundant_slots),
        "TOKENYARD_WORKER_EXPERT_REBALANCE_INTERVAL": str(args.expert_rebalance_interval),
    }


def _check_role_expert_parallel(role: str, tp: int, pp: int, ep: int) -> None:
    """One role's sizes as EngineConfig._check_expert_parallel takes them: ep 1, or ep
    ranks with tp 1 or ep, in one stage. `role` "" is the default the bare N sets."""
    if ep == 1:
        return
    size = f"{role}:{{}}" if role else "{}"
    whose = f" for the {role} workers" if role else ""
    if tp not in (1, ep):
        raise SystemExit(
            f"--expert-parallel-size {size.format(ep)} places experts over the worker's "
            f"ranks{whose}: use --tensor-parallel-size {size.format(1)} or {size.format(ep)}"
        )
    if pp > 1:
        raise SystemExit(
            f"--expert-parallel-size {size.format(ep)} does not combine with "
            f"--pipeline-parallel-size {size.format(pp)} yet (in stages the experts are "
            "sliced by --tensor-parallel-size)"
        )


def _parsers_env(args: argparse.Namespace) -> dict[str, str]:
    """The gateway's parser settings; an unknown name stops here, before anything starts."""
    from tokenyard.services.gateway.reasoning import syntax_named
    from tokenyard.services.gateway.tool_parsers import parser_named

    env = {}
    options: list[tuple[str, str | None, Callable[[str], object], str]] = [
        ("--tool-call-parser", args.tool_call_parser, parser_named, "TOOL_CALL_PARSER"),
        ("--reasoning-parser", args.reasoning_parser, syntax_named, "REASONING_PARSER"),
    ]
    for flag, value, check, setting in options:
        if value is None:
            continue
        try:
            check(value)
        except ValueError as exc:
            raise SystemExit(f"{flag}: {exc}") from exc
        env[f"TOKENYARD_GATEWAY_{setting}"] = value
    return env


def _aggregated(args: argparse.Namespace) -> bool:
    if args.aggregated or args.workers is not None:
        return True
    split_asked = args.disaggregated or args.prefill is not None or args.decode is not None
    return not split_asked and aggregated_by_default(args.device, os.cpu_count() or 1)


def _kv_cache_env(args: argparse.Namespace, kv_dtype: str) -> dict[str, str]:
    """A fixed KV pool per worker where one is asked for, or on a CPU without a budget;
    else none: each worker sizes its pool from its share of the memory budget."""
    budget = args.device != "cpu" or args.cpu_memory_utilization is not None
    if args.kv_cache_mib is None and budget:
        return {}
    kv_cache_mib = args.kv_cache_mib or (512 if kv_dtype == "float32" else 256)
    return {"TOKENYARD_WORKER_KV_CACHE_BYTES": str(kv_cache_mib * 1024**2)}


def _quantization(args: argparse.Namespace) -> str:
    """--quantization, or by default int4 on the CPU (none with expert parallelism, which
    moves plain weights) and none on cuda."""
    experts_placed = max(role_sizes(args.expert_parallel_size, "--expert-parallel-size").values())
    cpu_default = "int4" if experts_placed == 1 else "none"
    return args.quantization or (cpu_default if args.device == "cpu" else "none")


def _quantization_env(args: argparse.Namespace) -> dict[str, str]:
    quantization = _quantization(args)
    if args.device != "cpu" and quantization != "none":
        raise SystemExit(f"--quantization {quantization} runs on the CPU only; drop it for cuda")
    return {} if quantization == "none" else {"TOKENYARD_WORKER_QUANTIZATION": quantization}


def run(args: argparse.Namespace) -> int:
    from tokenyard.services.launch import preflight
    from tokenyard.services.launch.stack import ConfigError, LocalStack, StackError

    try:
        config = config_from(args)
        preflight.check(config)  # before anything starts
    except (SystemExit, ConfigError) as exc:
        return _config_error(exc)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    stack = LocalStack(config)
    keep_logs = False  # a failed stack's logs say why
    try:
        stack.start()
        print(
            f"Starting Tokenyard (NATS {redact(stack.nats_url)}; logs in {stack.log_dir}) ...",
            flush=True,
        )
        if not _wait_ready(stack, stop, args.ready_timeout):  # stopped while starting
            return 130
        with _saved_for_ctl(stack):
            _banner(stack)
            reported: set[str] = set()
            _report_down(stack, reported)  # given up on while the stack started
            with _autoscaler(stack, args) as scaler:
                while not stop.wait(0.5):
                    for name in stack.supervise():
                        print(f"{name} exited; restarted it (log: {stack.log_dir / name}.log)",
                              flush=True)  # fmt: skip
                    _report_down(stack, reported)
                    if scaler is not None:
                        _report_scaling(scaler.tick(), scaler.last_signals)
        print("\nStopping ...", flush=True)
        return 0
    except ConfigError as exc:  # a service that cannot run as configured; the line names its log
        keep_logs = True
        return _config_error(exc)
    except StackError as exc:
        keep_logs = True
        print(f"tokenyard up failed: {exc}\nlogs kept in {stack.log_dir}", flush=True)
        return 1
    finally:
        stack.stop(keep_logs=keep_logs)


@contextlib.contextmanager
def _autoscaler(stack: LocalStack, args: argparse.Namespace) -> Iterator[StackAutoscaler | None]:
    """With --autoscale: the heartbeat listener and the autoscaler, for the main loop."""
    if not args.autoscale:
        yield None
        return
    from tokenyard.autoscale.policy import AutoscaleSettings
    from tokenyard.services.launch.autoscaler import (
        HeartbeatWatch,
        LatencyWindow,
        StackAutoscaler,
    )

    bounds = {"prefill": args.min_workers, "decode": args.min_workers}
    settings = AutoscaleSettings(
        mode="sla",
        ttft_p99_s=args.slo_ttft_s,
        itl_p99_s=args.slo_itl_s,
        min_workers=bounds,
        max_workers={"prefill": args.max_workers, "decode": args.max_workers},
    )
    watch = HeartbeatWatch(stack.nats_url).start()
    try:
        yield StackAutoscaler(stack, watch, settings, latency=LatencyWindow())
    finally:
        watch.stop()


def _report_scaling(decision: Decision | None, signals: Signals | None) -> None:
    from tokenyard.services.launch.autoscaler import slo_note

    if decision is not None and (decision.start or decision.drain):
        note = slo_note(signals) if signals is not None else ""
        print(f"autoscale: {'; '.join(decision.reasons)}{note}", flush=True)


def _report_down(stack: LocalStack, reported: set[str]) -> None:
    """One line per optional service newly given up on: the stack serves on without it."""
    for name, why in stack.down.items():
        if name not in reported:
            reported.add(name)
            print(f"{why}; {name} is left down, the rest of the stack serves", flush=True)


def _config_error(exc: BaseException) -> int:
    """One line, no traceback, exit code 2: the stack cannot start as asked."""
    print(f"tokenyard up: {exc}", file=sys.stderr, flush=True)
    return 2


@contextlib.contextmanager
def _saved_for_ctl(stack: LocalStack) -> Iterator[None]:
    """The stack's control token and addresses in a file `tokenyard ctl` reads (mode 0600)."""
    values = {
        "gateway_url": stack.gateway_url,
        "grpc_token": stack.grpc_token,
        "facilities_control": stack.facilities_control,
        "facilities_admin_token": stack.facilities_admin_token,
    }
    running.save(values)
    try:
        yield
    finally:
        running.remove(values)


def _wait_ready(stack: LocalStack, stop: threading.Event, timeout: float) -> bool:
    from tokenyard.services.launch.stack import StackError

    waited = 0.0
    progress = StartProgress(stack.readiness_urls())
    while not stop.is_set():
        stack.supervise()
        body = stack.ready()
        ready = body is not None and stack.all_workers_registered(body)
        for line in progress.poll(waited):  # after the check: the last line is the gateway's
            print(line, flush=True)
        if ready:
            return True
        if waited > timeout:
            raise StackError(f"not ready after {timeout:.0f} s\n{stack.describe_failures()}")
        stop.wait(0.5)
        waited += 0.5
    return False


def _banner(stack: LocalStack) -> None:
    url = stack.gateway_url
    try:
        model = stack.fetch_model_id()
    except Exception:  # the banner must not fail the stack
        model = "SmolLM2-135M-Instruct"
    print(f"\nTokenyard is up: {url}  (OpenAI-compatible; docs at {url}/docs)")
    print(f"Metrics (Prometheus text, every worker's tokenyard:* series): {url}/metrics")
    print("Try:")
    print(
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", '
        '"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 32}' + "'"
    )
    if stack.facilities_url:
        fac, token = stack.facilities_url, stack.facilities_admin_token
        print(f"Facilities (racks, faults): {fac}/v1/racks  admin token: {token}")
        print(
            f"  curl -XPOST {fac}/v1/admin/racks/rack-a/faults -H 'Authorization: Bearer {token}' \\\n"
            "    -H 'Content-Type: application/json' -d '{\"kind\": \"pump_failure\"}'"
        )
        print(
            f"  tokenyard ctl facilities --addr {stack.facilities_control} "
            f"--admin-token {token} racks"
        )
    if stack.console_url:
        print(f"console: {stack.console_url}  (admin token: {stack.console_admin_token})")
    print(
        f"Gateway admin token (POST /v1/load_lora_adapter, /v1/unload_lora_adapter): "
        f"{stack.gateway_admin_token}"
    )
    print(
        f"Control (gRPC) token: {stack.grpc_token}  (`tokenyard ctl` reads it and the "
        f"addresses from {running.path()} while this runs)"
    )
    print("Ctrl-C stops everything.", flush=True)


class StartProgress:
    """One line per service the first time its /ready says 200, while the stack starts.

    A worker loading a large model takes most of a start; the lines say who is still missing.
    """

    def __init__(self, urls: dict[str, str], timeout: float = 0.3) -> None:
        self.pending = dict(urls)
        self.timeout = timeout

    def poll(self, elapsed: float) -> list[str]:
        import urllib.request

        lines = []
        for name, url in list(self.pending.items()):
            try:
                with urllib.request.urlopen(url, timeout=self.timeout):
                    pass  # 200: ready (a 503 raises)
            except Exception:
                continue
            del self.pending[name]
            waiting = f"; waiting for {', '.join(self.pending)}" if self.pending else ""
            lines.append(f"  {name} ready ({elapsed:.0f} s){waiting}")
        return lines
