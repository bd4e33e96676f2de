"""The compiler half: targets ``cpu``, refuses to compile (the interpreter never asks)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from triton.backends.compiler import BaseBackend, GPUTarget

_WHY = "the hs_triton_interp_cpu shim cannot compile Triton kernels; run with TRITON_INTERPRET=1"


class InterpreterOnlyCpuBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "hs-triton-interp-cpu-0"

    def parse_options(self, options: dict[str, Any]) -> object:
        raise RuntimeError(_WHY)

    def add_stages(self, stages: dict[str, Any], options: object, language: Any) -> None:
        raise RuntimeError(_WHY)

    def load_dialects(self, context: Any) -> None:
        return None

    def get_module_map(self) -> dict[str, ModuleType]:
        return {}
