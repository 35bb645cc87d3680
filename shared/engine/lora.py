"""Which LoRA adapters the engine holds, and which of them sit in the model's slots.

Adapters are loaded into host memory (at most `max_cpu_loras`); the model's LoRALinear
layers hold `max_loras` slots. A sequence pins its adapter's slot while it runs (the
scheduler pins at admission and unpins at preemption or finish), so a step never needs
more adapters than there are slots. Admitting a sequence whose adapter is not in a slot
takes a free slot or evicts the least recently used adapter that no running sequence
pins; when every slot is pinned the sequence waits (`can_pin` is False), as vLLM does.

Unloading an adapter that unfinished requests still use only marks it: new requests are
refused at once, and the engine removes it when the last of those requests ends.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch

from tokenyard.engine.outputs import AdapterInfo, UnknownAdapter
from tokenyard.models.config import ModelConfig
from tokenyard.models.lora import LoRABatch, LoRALinear, set_slot
from tokenyard.models.lora_adapter import AdapterLimit, LoRAAdapter, load_adapter

__all__ = ["AdapterInfo", "LoRAManager", "UnknownAdapter"]


class LoRAManager:
    def __init__(
        self,
        layers: list[dict[str, LoRALinear]],
        batch: LoRABatch,
        config: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
    ) -> None:
        self.layers = layers
        self.batch = batch
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: list[str | None] = [None] * max_loras
        self.pins: Counter[str] = Counter()
        self.unloading: set[str] = set()
        self._recent: OrderedDict[str, None] = OrderedDict()  # slot residents, LRU first
        self.num_swaps = 0  # adapters copied into a slot
        self.device = layers[0]["o_proj"].a.device if layers else torch.device("cpu")

    # --- loading and unloading -----------------------------------------------------------

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and check the adapter; refuse a name in use or beyond max_cpu_loras."""
        if not name:
            raise ValueError("an adapter needs a name")
        if name in self.adapters:
            raise AdapterLimit("name", f"a LoRA adapter named {name!r} is already loaded")
        if len(self.adapters) >= self.max_cpu_loras:
            raise AdapterLimit(
                "max_cpu_loras",
                f"{len(self.adapters)} LoRA adapters are loaded: max_cpu_loras "
                f"({self.max_cpu_loras}) reached; unload one first",
            )
        adapter = load_adapter(name, path, self.config, self.max_lora_rank)
        self.adapters[name] = adapter
        return adapter

    def room(self) -> int:
        """How many more adapters load() takes now (unloading ones still count)."""
        return max(0, self.max_cpu_loras - len(self.adapters))

    def unload(self, name: str, in_use: bool) -> bool:
        """Remove the adapter now (True), or mark it to go once its requests end (False)."""
        if name not in self.adapters or name in self.unloading:
            raise UnknownAdapter(name)
        if in_use:
            self.unloading.add(name)
            return False
        self._remove(name)
        return True

    def finish_unloads(self, in_use: set[str]) -> None:
        """Remove the adapters marked for unloading that no request uses any more."""
        for name in list(self.unloading - in_use):
            self._remove(name)

    def _remove(self, name: str) -> None:
        assert self.pins[name] == 0, f"adapter {name!r} is pinned by running sequences"
        self.unloading.discard(name)
        del self.adapters[name]
        self._recent.pop(name, None)
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot] = None
            set_slot(self.layers, slot, None)

    def check(self, name: str) -> None:
        """Raise UnknownAdapter unless a new request may use `name`."""
        if name not in self.adapters:
            raise UnknownAdapter(name)
        if name in self.unloading:
            raise UnknownAdapter(name, " (it is being unloaded)")

    def info(self) -> list[AdapterInfo]:
        return [
            AdapterInfo(
                a.name,
                a.path,
                a.rank,
                self.slots.index(a.name) if a.name in self.slots else None,
                self.pins[a.name],
                a.name in self.unloading,
            )
            for a in self.adapters.values()
        ]

    # --- slots: pinned by running sequences ----------------------------------------------

    def can_pin(self, name: str) -> bool:
        return name in self.slots or self._free_slot() is not None

    def pin(self, name: str) -> None:
        """Make sure `name` is in a slot and keep it there until unpinned."""
        if name not in self.slots:
            slot = self._free_slot()
            if slot is None:
                raise AdapterLimit(
                    "max_loras", f"all {len(self.slots)} LoRA slots (max_loras) are in use"
                )
            evicted = self.slots[slot]
            if evicted is not None:
                self._recent.pop(evicted, None)
            self.slots[slot] = name
            set_slot(self.layers, slot, self.adapters[name])
            self.num_swaps += 1
        self.pins[name] += 1
        self._recent[name] = None
        self._recent.move_to_end(name)

    def unpin(self, name: str) -> None:
        assert self.pins[name] > 0, f"adapter {name!r} is not pinned"
        self.pins[name] -= 1

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used slot no running sequence pins."""
        if None in self.slots:
            return self.slots.index(None)
        for name in self._recent:
            if self.pins[name] == 0:
                return self.slots.index(name)
        return None

    # --- the step ------------------------------------------------------------------------

    def prepare_step(self, row_adapters: list[tuple[str, int]], prompt: bool) -> None:
        """Group the step's rows by slot: `row_adapters` is each span's (adapter name or
        '', number of rows), in the step's row order."""
        rows: dict[int, list[int]] = {}
        start = 0
        for name, n in row_adapters:
            if name:
                rows.setdefault(self.slots.index(name), []).extend(range(start, start + n))
            start += n
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot, ids in rows.items():
            every = len(ids) == start
            index = None if every else torch.tensor(ids, dtype=torch.long, device=self.device)
            groups.append((slot, index))
        self.batch.groups = groups
        self.batch.prompt = prompt
