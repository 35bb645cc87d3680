"""`LeanModule`: an nn.Module with less per-call overhead, for the decode hot path.

At batch 1 a 30-layer model makes about 270 module calls per step. nn.Module's `__call__`
(hook and tracing checks) and its `__getattr__` for submodules cost about 5 microseconds per
call together, 1.3 ms of a 12 ms CPU decode step. A LeanModule's call goes straight to
`forward`, and its submodules are also plain instance attributes, so looking them up
skips `__getattr__`. What it gives up: forward hooks and pre-hooks are never run.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class LeanModule(nn.Module):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)  # registers parameters, buffers and submodules
        if isinstance(value, nn.Module):
            object.__setattr__(self, name, value)  # and mirrors submodules for fast lookup

    def __delattr__(self, name: str) -> None:
        self.__dict__.pop(name, None)
        super().__delattr__(name)
