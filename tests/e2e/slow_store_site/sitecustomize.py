"""Test-only: makes the tiercache connector store slowly in every process that starts with this
directory first on its PYTHONPATH (``tests/e2e/test_prefill_decode.py``'s prefill engine).

vLLM's CPU platform spawns its engine and worker processes, so a patch made in the server's process
would not reach the worker that stores: Python imports ``sitecustomize`` at the start of every
process, spawned ones included. Every page copy of a store (after the chunk's arena slots are
reserved, before they are committed) first waits until the file ``TIERCACHE_TEST_STORE_GATE``
names exists (when set; at most :data:`GATE_LIMIT_S`), then sleeps ``TIERCACHE_TEST_STORE_DELAY_S``
(when set): a prefill engine's stores are still in flight when its responses return, as they are
under load, for as long as the test keeps the gate shut. Nothing of vLLM is patched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from types import ModuleType
from typing import Any

TARGET = "tiercache.connector.copy"
#: The longest a store waits for the gate: a test that never opens it fails on its own bound first.
GATE_LIMIT_S = 300.0


class _Patch(importlib.abc.MetaPathFinder):
    """Lets ``TARGET`` load as usual, then wraps ``CpuPageCopy.save`` with the sleep."""

    def __init__(self, gate: str, delay_s: float) -> None:
        self.gate = gate
        self.delay_s = delay_s

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module once, without us
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, gate, delay_s = spec.loader, self.gate, self.delay_s

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                real_save = module.CpuPageCopy.save

                def slow_save(self: Any, *args: Any, **kwargs: Any) -> None:
                    end = time.monotonic() + GATE_LIMIT_S
                    while gate and not os.path.exists(gate) and time.monotonic() < end:
                        time.sleep(0.01)
                    if delay_s > 0:
                        time.sleep(delay_s)
                    real_save(self, *args, **kwargs)

                module.CpuPageCopy.save = slow_save

        spec.loader = Loader()
        return spec


_gate = os.environ.get("TIERCACHE_TEST_STORE_GATE", "")
_delay = float(os.environ.get("TIERCACHE_TEST_STORE_DELAY_S", "0") or 0)
if _gate or _delay > 0:
    sys.meta_path.insert(0, _Patch(_gate, _delay))
