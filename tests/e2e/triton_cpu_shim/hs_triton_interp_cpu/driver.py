"""The driver half: never active (Triton's driver selection must not pick it), describes the CPU."""

from __future__ import annotations

from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyCpuDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise RuntimeError("the hs_triton_interp_cpu shim has no benchmarker")
