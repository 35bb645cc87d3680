"""What `tokenyard up` checks before it starts anything: the model, the ports, the inventory.

Each check raises ConfigError with one line that names the problem and the fix, so a stack
that cannot be whole fails in a second instead of starting services that then fail one by
one (and a user who types a Hugging Face id, as with vLLM, learns at once that it needs a
local copy).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.config import ConfigError, StackConfig

# owner/name, as on the Hugging Face Hub; only asked about when no such path exists here.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check(config: StackConfig) -> None:
    """Every check of a stack to start; ConfigError at the first that fails."""
    from tokenyard.services.launch.stack import facilities_inventory

    check_model(config.model)
    if config.gateway and config.port:
        check_port(config.host, config.port, "--port")
    if config.telemetry and config.console_port:
        if config.gateway and config.console_port == config.port:
            raise ConfigError(f"--console-port {config.console_port} is the gateway's --port too")
        check_port(config.host, config.console_port, "--console-port")
    if config.facilities:
        facilities_inventory()


def check_model(model: str | None) -> None:
    """The model is a .gguf file or a model folder here, and its tokenizer loads (the
    default model, shipped with the package, needs only to be there)."""
    from tokenyard.models.loader import default_model_path, load_tokenizer

    if not model:
        try:
            default_model_path()
        except Exception as exc:  # its package is not installed
            raise ConfigError(str(exc)) from exc
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(_missing(model))
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"--model {model}: not a .gguf file (give a .gguf file or a folder)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"--model {model}: no config.json in it (not a Hugging Face folder)")
    try:
        load_tokenizer(str(path))
    except Exception as exc:  # any reason the workers would fail on it at start
        raise ConfigError(f"--model {model}: cannot be read: {exc}") from exc


def _missing(model: str) -> str:
    if _HUB_ID.fullmatch(model):
        name = model.split("/")[1]
        return (
            f"--model {model}: no such file or folder here, and tokenyard does not download "
            f"from the Hugging Face Hub: download it first (e.g. `huggingface-cli download "
            f"{model} --local-dir {name}`), then pass the folder: --model ./{name}"
        )
    return f"--model {model}: no such file or folder (give a .gguf file or a model folder)"


def check_port(host: str, port: int, option: str) -> None:
    """The port is free to listen on (as the service will: with SO_REUSEADDR)."""
    if not 0 < port < 65536:
        raise ConfigError(f"{option} {port}: not a port (1 to 65535)")
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address here ({exc.strerror})") from exc
    with socket.socket(family, kind) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise ConfigError(
                f"{option} {port}: {host}:{port} is not free ({exc.strerror}); "
                f"pick another, e.g. {option} {free_port()}"
            ) from exc
