"""The `tokenyard` command: every sub-command is there, or the command says what is missing."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import pytest

from tokenyard import cli


def test_every_sub_command_is_registered(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("generate", "up", "bench"))


def test_a_missing_sub_command_module_is_an_error_not_a_gap(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("tokenyard.services.ghost", "not built"))
    with pytest.raises(SystemExit, match="tokenyard ghost: cannot import tokenyard.services.ghost"):
        cli.main(["generate", "--help"])


def test_up_takes_the_options_the_readme_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    out = capsys.readouterr().out
    for option in (
        "--prefill",
        "--decode",
        "--aggregated",
        "--model",
        "--nats-url",
        "--port",
        "--dtype",
        "--quantization",
        "--no-kvcache",
        "--no-facilities",
        "--log-dir",
        "--speculative",
        "--cpu-memory-utilization",
    ):
        assert option in out, option


def test_up_passes_speculative_config_to_the_workers():
    from tokenyard.cli import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    spec = '{"method": "draft", "model": null, "quantization": "int4"}'
    config = up.config_from(parser.parse_args(["--quantization", "none", "--speculative", spec]))
    assert config.worker_env["TOKENYARD_WORKER_SPECULATIVE"] == spec
    assert "TOKENYARD_WORKER_SPECULATIVE" not in up.config_from(parser.parse_args([])).worker_env
    with pytest.raises(SystemExit, match="--speculative: speculative method must be one of"):
        up.config_from(parser.parse_args(["--speculative", '{"method": "eagle"}']))
    with pytest.raises(SystemExit, match="add --quantization none"):
        up.config_from(parser.parse_args(["--speculative", spec]))  # default int4 target


def test_worker_settings_refuse_a_bad_speculative_config():
    from pydantic import ValidationError

    from tokenyard.services.worker.settings import WorkerSettings

    assert WorkerSettings(speculative='{"method": "ngram"}').speculative == '{"method": "ngram"}'
    with pytest.raises(ValidationError, match="not valid JSON"):
        WorkerSettings(speculative="{ngram")


def test_up_without_a_facilities_inventory_says_why_and_starts_nothing(tmp_path):
    missing = tmp_path / "inventory.yaml"
    env = {**os.environ, "TOKENYARD_FACILITIES_INVENTORY_PATH": str(missing)}
    argv = [sys.executable, "-m", "tokenyard.cli", "up", "--port", "0"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2  # a configuration error
    assert f"{missing} does not exist" in done.stderr and "--no-facilities" in done.stderr
    assert "Starting Tokenyard" not in done.stdout  # printed once every service is started


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--model", "/nonexistent"], ["--model /nonexistent: no such file or folder"]),
        (
            ["--model", "Qwen/Qwen2.5-0.5B-Instruct"],
            ["does not download from the Hugging Face Hub", "--model ./Qwen2.5-0.5B-Instruct"],
        ),
        (["--port", "TAKEN"], ["is not free", "pick another, e.g. --port "]),
        (["--console-port", "TAKEN"], ["is not free", "--console-port "]),
    ],
)
def test_up_refuses_a_bad_model_or_a_taken_port_in_one_line(argv, needles, taken_port):
    argv = [a.replace("TAKEN", str(taken_port)) for a in argv]
    command = [sys.executable, "-m", "tokenyard.cli", "up", *argv]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and not done.stdout  # no traceback
    assert all(n in done.stderr for n in needles), done.stderr
    # Imports only (about 5 s on a loaded 2-core machine): no service was started.
    assert time.monotonic() - started < 60


def test_preflight_checks_the_model_folder_and_file(tmp_path):
    from tokenyard.services.launch.config import ConfigError
    from tokenyard.services.launch.preflight import check_model

    text = tmp_path / "model.bin"
    text.write_text("not a model")
    with pytest.raises(ConfigError, match="not a .gguf file"):
        check_model(str(text))
    with pytest.raises(ConfigError, match="no config.json"):
        check_model(str(tmp_path))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but no more")
    with pytest.raises(ConfigError, match="cannot be read"):
        check_model(str(broken))
    check_model(None)  # the default model is installed


def up_config(*argv: str):
    from tokenyard.cli import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return up.config_from(parser.parse_args(list(argv)))


def test_up_picks_quantization_per_device():
    cpu = up_config()
    assert cpu.device == "cpu" and cpu.worker_env["TOKENYARD_WORKER_QUANTIZATION"] == "int4"
    gpu = up_config("--device", "cuda", "--gpu-memory-utilization", "0.8")
    assert gpu.device == "cuda" and gpu.gpu_memory_utilization == 0.8
    assert "TOKENYARD_WORKER_QUANTIZATION" not in gpu.worker_env
    with pytest.raises(SystemExit, match="runs on the CPU only"):
        up_config("--device", "cuda", "--quantization", "int4")


def test_up_passes_the_parsers_to_the_gateway():
    config = up_config("--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1")
    assert config.gateway_env == {
        "TOKENYARD_GATEWAY_TOOL_CALL_PARSER": "mistral",
        "TOKENYARD_GATEWAY_REASONING_PARSER": "deepseek_r1",
    }
    assert up_config().gateway_env == {}


def test_up_sizes_the_kv_pool_by_its_dtype():
    mib = 1024**2
    fp32 = up_config("--dtype", "float32")  # an fp16 pool beside it by default
    assert fp32.worker_env["TOKENYARD_WORKER_KV_CACHE_DTYPE"] == "float16"
    assert fp32.worker_env["TOKENYARD_WORKER_KV_CACHE_BYTES"] == str(256 * mib)
    full = up_config("--dtype", "float32", "--kv-cache-dtype", "float32")
    assert full.worker_env["TOKENYARD_WORKER_KV_CACHE_DTYPE"] == "float32"
    assert full.worker_env["TOKENYARD_WORKER_KV_CACHE_BYTES"] == str(512 * mib)
    bf16 = up_config("--dtype", "bfloat16")
    assert bf16.worker_env["TOKENYARD_WORKER_KV_CACHE_DTYPE"] == "bfloat16"
    assert bf16.worker_env["TOKENYARD_WORKER_KV_CACHE_BYTES"] == str(256 * mib)
    with pytest.raises(SystemExit, match="--kv-cache-dtype: kv_cache_dtype 'float16' with"):
        up_config("--dtype", "bfloat16", "--kv-cache-dtype", "float16")


def test_up_cpu_memory_utilization_sizes_the_pools_unless_a_size_is_given():
    budgeted = up_config("--cpu-memory-utilization", "0.5")
    assert budgeted.cpu_memory_utilization == 0.5
    assert "TOKENYARD_WORKER_KV_CACHE_BYTES" not in budgeted.worker_env
    fixed = up_config("--cpu-memory-utilization", "0.5", "--kv-cache-mib", "64")
    assert fixed.worker_env["TOKENYARD_WORKER_KV_CACHE_BYTES"] == str(64 * 1024**2)
    assert up_config().cpu_memory_utilization is None
    # on a GPU the pool comes from --gpu-memory-utilization unless a size is given
    assert "TOKENYARD_WORKER_KV_CACHE_BYTES" not in up_config("--device", "cuda").worker_env
    with pytest.raises(SystemExit, match="--cpu-memory-utilization is for --device cpu"):
        up_config("--device", "cuda", "--cpu-memory-utilization", "0.5")


def test_up_deterministic_reaches_the_workers():
    config = up_config("--deterministic")
    assert config.worker_env["TOKENYARD_WORKER_DETERMINISTIC"] == "1"
    assert "TOKENYARD_WORKER_DETERMINISTIC" not in up_config().worker_env
    with pytest.raises(SystemExit, match="needs --quantization"):
        up_config("--deterministic", "--quantization", "none")


def test_up_tensor_parallel_size_reaches_the_stack():
    assert up_config().tensor_parallel_size == 1
    assert up_config("--tensor-parallel-size", "2").tensor_parallel_size == 2
    with pytest.raises(SystemExit, match="at least 1"):
        up_config("--tensor-parallel-size", "0")
    with pytest.raises(SystemExit, match="runs on one rank only"):
        up_config("--tensor-parallel-size", "2", "--speculative", '{"method": "ngram"}')


def test_up_parallel_sizes_per_role_reach_each_roles_workers():
    from tokenyard.services.launch.config import WorkerParallel
    from tokenyard.services.launch.placement import Placement

    config = up_config(
        "--prefill", "1", "--decode", "2",
        "--tensor-parallel-size", "prefill:1,decode:2",
        "--pipeline-parallel-size", "2",
    )  # fmt: skip
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (1, 2)
    assert config.parallel("prefill") == WorkerParallel(1, 2)
    assert config.parallel("decode") == WorkerParallel(2, 2)
    assert config.parallel("decode").env() == {
        "TOKENYARD_WORKER_TENSOR_PARALLEL_SIZE": "2",
        "TOKENYARD_WORKER_PIPELINE_PARALLEL_SIZE": "2",
        "TOKENYARD_WORKER_EXPERT_PARALLEL_SIZE": "1",
    }
    placement = Placement(config)
    assert placement.planned_ranks() == 1 * 2 + 2 * 4
    assert placement.gpus_per_worker() == 4
    # A bare N in the list sets the roles not named.
    mixed = up_config("--pipeline-parallel-size", "2,decode:1")
    assert mixed.parallel("prefill").pipeline_parallel_size == 2
    assert mixed.parallel("decode").pipeline_parallel_size == 1
    with pytest.raises(SystemExit, match="unknown role 'router'"):
        up_config("--pipeline-parallel-size", "router:2")
    with pytest.raises(SystemExit, match="--pipeline-parallel-size must be at least 1"):
        up_config("--pipeline-parallel-size", "decode:x")
    with pytest.raises(SystemExit, match="runs on one rank only"):
        up_config("--pipeline-parallel-size", "2", "--speculative", '{"method": "ngram"}')


def test_up_expert_parallel_size_reaches_the_stack_and_the_workers():
    assert up_config().expert_parallel_size == 1
    config = up_config(
        "--expert-parallel-size",
        "2",
        "--tensor-parallel-size",
        "2",
        "--expert-redundant-slots",
        "1",
        "--expert-rebalance-interval",
        "100",
    )
    assert config.expert_parallel_size == 2 and config.parallel("both").world_size == 2
    assert config.parallel("both").env()["TOKENYARD_WORKER_EXPERT_PARALLEL_SIZE"] == "2"
    with pytest.raises(SystemExit, match="does not combine with --pipeline-parallel-size"):
        up_config("--expert-parallel-size", "2", "--pipeline-parallel-size", "2")
    assert config.worker_env["TOKENYARD_WORKER_EXPERT_REDUNDANT_SLOTS"] == "1"
    assert config.worker_env["TOKENYARD_WORKER_EXPERT_REBALANCE_INTERVAL"] == "100"
    # the weights stay plain on the CPU: the balancer copies them between ranks
    assert "TOKENYARD_WORKER_QUANTIZATION" not in config.worker_env
    with pytest.raises(SystemExit, match="--tensor-parallel-size 1 or 4"):
        up_config("--expert-parallel-size", "4", "--tensor-parallel-size", "2")
    with pytest.raises(SystemExit, match="runs unquantized"):
        up_config("--expert-parallel-size", "2", "--quantization", "int4")
    with pytest.raises(SystemExit, match="at least 1"):
        up_config("--expert-parallel-size", "0")


def test_up_expert_parallel_size_per_role_reaches_each_roles_workers():
    from tokenyard.services.launch.config import WorkerParallel

    config = up_config(
        "--prefill", "1", "--decode", "1",
        "--tensor-parallel-size", "prefill:1,decode:2",
        "--expert-parallel-size", "decode:2",
    )  # fmt: skip
    assert config.expert_parallel_size == 1
    assert config.parallel("prefill") == WorkerParallel(1, 1, 1)
    assert config.parallel("decode") == WorkerParallel(2, 1, 2)
    assert config.parallel("decode").env()["TOKENYARD_WORKER_EXPERT_PARALLEL_SIZE"] == "2"
    assert config.parallel("prefill").env()["TOKENYARD_WORKER_EXPERT_PARALLEL_SIZE"] == "1"
    # one role's experts placed is enough for the balancer's settings and plain weights
    assert config.worker_env["TOKENYARD_WORKER_EXPERT_REBALANCE_INTERVAL"] == "0"
    assert "TOKENYARD_WORKER_QUANTIZATION" not in config.worker_env
    # a bare N sets the roles not named; ep over whole-attention ranks beside tp=ep ones
    mixed = up_config("--expert-parallel-size", "4,prefill:1", "--tensor-parallel-size", "4")
    assert mixed.parallel("prefill") == WorkerParallel(4, 1, 1)
    assert mixed.parallel("decode") == WorkerParallel(4, 1, 4)
    assert mixed.parallel("both").world_size == 4
    assert (
        up_config("--expert-parallel-size", "both:1").worker_env.get(
            "TOKENYARD_WORKER_QUANTIZATION"
        )
        == "int4"
    )  # no role places experts: the CPU default stays


def test_up_expert_parallel_size_per_role_is_checked_against_that_roles_sizes():
    with pytest.raises(SystemExit, match="--tensor-parallel-size decode:1 or decode:2$"):
        up_config("--expert-parallel-size", "decode:2", "--tensor-parallel-size", "4")
    with pytest.raises(SystemExit, match="ranks for the prefill workers"):
        up_config("--expert-parallel-size", "prefill:4", "--tensor-parallel-size", "prefill:2")
    with pytest.raises(SystemExit, match="decode:2 does not combine with --pipeline-parallel"):
        up_config("--expert-parallel-size", "decode:2", "--pipeline-parallel-size", "decode:2")
    # stages on the roles whose experts are not placed are fine
    staged = up_config(
        "--expert-parallel-size", "decode:2", "--pipeline-parallel-size", "2,decode:1"
    )
    assert staged.parallel("prefill").pipeline_parallel_size == 2
    with pytest.raises(SystemExit, match="unknown role 'router'"):
        up_config("--expert-parallel-size", "router:2")
    with pytest.raises(SystemExit, match="--expert-parallel-size must be at least 1"):
        up_config("--expert-parallel-size", "decode:0")
    with pytest.raises(SystemExit, match="runs unquantized"):
        up_config("--expert-parallel-size", "decode:2", "--quantization", "int8")
    with pytest.raises(SystemExit, match="--lora runs on one rank only"):
        up_config("--expert-parallel-size", "prefill:2", "--lora", "a=/nonexistent")


def test_the_default_layout_follows_the_host(monkeypatch):
    from tokenyard.cli import up

    assert up.aggregated_by_default("cpu", 2) and not up.aggregated_by_default("cpu", 4)
    assert not up.aggregated_by_default("cuda", 2)
    monkeypatch.setattr(up.os, "cpu_count", lambda: 2)
    assert up_config().aggregated
    assert not up_config("--disaggregated").aggregated
    assert not up_config("--decode", "2").aggregated  # asking for workers asks for a split
    assert not up_config("--device", "cuda").aggregated
    monkeypatch.setattr(up.os, "cpu_count", lambda: 8)
    assert not up_config().aggregated and up_config("--aggregated").aggregated


def test_up_runs_several_aggregated_workers_and_a_round_robin_router():
    from tokenyard.services.launch.placement import Placement

    two = up_config("--workers", "2", "--router-placement", "round-robin")
    assert two.aggregated and two.workers == 2
    assert Placement(two).planned_workers() == 2
    assert two.router_env["TOKENYARD_ROUTER_PLACEMENT"] == "round-robin"
    assert up_config().router_env["TOKENYARD_ROUTER_PLACEMENT"] == "kv-aware"
    for bad in (["--workers", "0"], ["--workers", "2", "--decode", "1"]):
        with pytest.raises(SystemExit, match="--workers takes 1 or more"):
            up_config(*bad)


def test_up_and_keys_import_no_service_until_they_run():
    # The library sits below the services: the launcher and the key store load inside run().
    code = (
        "import sys, tokenyard.cli.up, tokenyard.cli.keys\n"
        "print(sorted(m for m in sys.modules if m.startswith('tokenyard.services')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plan_help_shows_defaults_and_what_users_means(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "concurrent streams" in out and "(default: 1000)" in out
    assert "(default: llama-3.1-70b)" in out and "(default: None)" not in out


def test_plan_converts_daily_users_into_concurrent_streams(capsys):
    from tokenyard.cli import plan

    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    # 100,000 users x 10 requests a day, twice the mean in the busiest hour: 23.1 arrivals/s,
    # each answer 256 tokens at 20 tokens/s = 12.8 s: 296.3 streams at once.
    args = parser.parse_args(["--daily-users", "100000"])
    assert plan.concurrent_users(args) == 297
    assert plan.concurrent_users(parser.parse_args(["--users", "50"])) == 50
    assert cli.main(["plan", "--daily-users", "100000", "--requests-per-user-day", "0"]) == 2
    assert "--requests-per-user-day above 0" in capsys.readouterr().err


def test_simulate_tables_fit_80_columns():
    from rich.console import Console

    from tokenyard.cli.simulate import show

    run = {"pd_ratio": "12:36", "policy": "kv-aware+facilities", "goodput_req_s": 1234.567,
           "ttft_p50_ms": 12345.67, "ttft_p99_ms": 123456.78, "itl_p50_ms": 123.45,
           "itl_p99_ms": 1234.56, "prefix_hit_rate": 0.5951, "throttle_events": 12345,
           "rack_peak_kw": 1234.56, "rejected": 123456}  # fmt: skip
    report = {"model": "llama-3.1-70b", "gpus": 1000, "hardware": "h100", "tp": 4,
              "workload": "shared-prefix", "runs": [run, {**run, "policy": "round-robin"}]}  # fmt: skip
    console = Console(width=80, record=True)
    show(report, console)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for value in ("kv-aware+facilities", "12:36", "123,457", "123.5", "0.595", "123456"):
        assert value in text


def test_up_saves_its_control_token_for_ctl_and_prints_it(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from tokenyard.cli import ctl, running, up

    monkeypatch.setenv("TOKENYARD_RUN_FILE", str(tmp_path / "run" / "up.json"))
    monkeypatch.delenv("TOKENYARD_GRPC_TOKEN", raising=False)
    monkeypatch.delenv("TOKENYARD_FACILITIES_ADMIN_TOKEN", raising=False)
    stack = SimpleNamespace(
        gateway_url="http://127.0.0.1:8000",
        grpc_token="grpc-secret",
        facilities_url="",
        facilities_control="127.0.0.1:50123",
        facilities_admin_token="admin-secret",
        console_url="",
        gateway_admin_token="gateway-admin-secret",
        fetch_model_id=lambda: "m",
    )
    with up._saved_for_ctl(stack):
        assert (running.path().stat().st_mode & 0o777) == 0o600
        up._banner(stack)
        parser = argparse.ArgumentParser()
        ctl.add_arguments(parser)
        worker = parser.parse_args(["worker", "status", "127.0.0.1:1"])
        assert ctl.security_for(worker).token == "grpc-secret"
        racks = parser.parse_args(["facilities", "racks"])
        assert ctl.security_for(racks).token == "admin-secret"
        assert ctl.address_for(racks, running.load()) == "127.0.0.1:50123"
        given = parser.parse_args(["--token", "mine", "worker", "status", "127.0.0.1:1"])
        assert ctl.security_for(given).token == "mine"
    printed = capsys.readouterr().out
    assert "grpc-secret" in printed and "gateway-admin-secret" in printed
    assert not running.path().exists()  # removed with the stack
    assert ctl.security_for(worker).token == ""
    assert ctl.address_for(racks, running.load()) == ctl.DEFAULT_FACILITIES


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kv-cache-mib", "0"], "--kv-cache-mib must be at least 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be above 0"),
        (["--cpu-memory-utilization", "0"], "--cpu-memory-utilization must be above 0"),
        (["--ready-timeout", "0"], "--ready-timeout must be above 0"),
        (["--tool-call-parser", "nope"], "--tool-call-parser: unknown tool-call parser 'nope'"),
        (["--reasoning-parser", "think"], "--reasoning-parser: unknown reasoning parser"),
    ],
)
def test_up_refuses_bad_numbers_before_it_starts(argv, needle, capsys):
    assert cli.main(["up", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1


def test_start_progress_prints_each_service_once_when_its_ready_answers_200():
    import http.server
    import threading

    from tokenyard.cli.up import StartProgress

    class Handler(http.server.BaseHTTPRequestHandler):
        ready = {"/router/ready"}

        def do_GET(self):
            self.send_response(200 if self.path in self.ready else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        progress = StartProgress({"router": f"{base}/router/ready", "both-1": f"{base}/w/ready"})
        assert progress.poll(1.0) == ["  router ready (1 s); waiting for both-1"]
        assert progress.poll(1.5) == []  # the worker still says 503; the router is not repeated
        Handler.ready.add("/w/ready")
        assert progress.poll(12.0) == ["  both-1 ready (12 s)"]
    finally:
        server.shutdown()


def test_up_gives_the_kv_cache_a_disk_tier_when_asked(tmp_path):
    from tokenyard.services.launch.stack import kvcache_disk_env

    assert up_config().kvcache_disk_dir == ""
    config = up_config("--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-gb", "0.5")
    assert config.kvcache_disk_dir == str((tmp_path / "kv").resolve())
    env = kvcache_disk_env(config)
    assert env == {
        "TOKENYARD_KVCACHE_DISK_DIR": str((tmp_path / "kv").resolve()),
        "TOKENYARD_KVCACHE_DISK_BYTES": str(512 * 1024**2),
    }
    with pytest.raises(SystemExit, match="--kv-disk-dir needs the KV-cache service"):
        up_config("--kv-disk-dir", str(tmp_path), "--no-kvcache")
