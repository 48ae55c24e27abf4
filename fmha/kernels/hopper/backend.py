"""The Hopper backend: the dispatcher's view of the kernels (support check, cache key, prepare,
for the forward, the backward, decode, NSA's selection and its top-k). Their host sides:
``forward_runner.py``, ``backward_runner.py``, ``decode_runner.py``, ``selection_runner.py``,
``topk_runner.py``."""

from __future__ import annotations

from typing import Callable

from fmha.jit import disk_cache
from fmha.problem import AttentionProblem, KernelOptions

from .backward_runner import HopperBackwardRunner, compile_backward
from .config import HopperForwardConfig, why_unsupported, why_unsupported_decode
from .bwd_config import HopperBackwardConfig, why_unsupported_backward
from .decode_runner import HopperDecodeRunner, HopperDenseDecodeRunner, served_as_decode
from .forward_runner import HopperRunner, compile_forward
from .selection_runner import (HopperSelectionBackwardRunner, HopperSelectionRunner, backward_config_of,
                               why_unsupported_selection, why_unsupported_selection_backward)
from .selection_runner import config_of as selection_config_of
from .topk_runner import HopperTopKRunner, why_unsupported_topk
from .topk_runner import config_of as topk_config_of


class HopperBackend:
    name = "hopper"
    #: compute capabilities this kernel runs on
    capabilities = ((9, 0),)

    def why_unsupported(self, problem: AttentionProblem, options: KernelOptions) -> list:
        return why_unsupported(problem, options)

    def cache_key(self, problem: AttentionProblem, options: KernelOptions):
        if served_as_decode(problem, options):
            return ("decode",) + self.decode_cache_key(problem, options)
        return HopperForwardConfig.from_problem(problem, options)

    def prepare(self, problem: AttentionProblem, options: KernelOptions) -> Callable:
        if served_as_decode(problem, options):
            return HopperDenseDecodeRunner(problem)
        cfg = HopperForwardConfig.from_problem(problem, options)
        return HopperRunner(cfg, disk_cache.load_or_compile(cfg, compile_forward))

    def why_unsupported_decode(self, problem, options: KernelOptions) -> list:
        return why_unsupported_decode(problem)

    def decode_cache_key(self, problem, options: KernelOptions):
        """What the decode runner depends on beyond each call's sizes (its kernels compile lazily,
        and it plans each problem itself)."""
        return (problem.dtype, problem.head_dim)

    def prepare_decode(self, problem, options: KernelOptions) -> HopperDecodeRunner:
        return HopperDecodeRunner(problem)

    def why_unsupported_selection(self, problem, options: KernelOptions) -> list:
        return why_unsupported_selection(problem)

    def selection_cache_key(self, problem, options: KernelOptions):
        return selection_config_of(problem)

    def prepare_selection(self, problem, options: KernelOptions) -> HopperSelectionRunner:
        return HopperSelectionRunner(problem)

    def why_unsupported_topk(self, problem, options: KernelOptions) -> list:
        return why_unsupported_topk(problem)

    def topk_cache_key(self, problem, options: KernelOptions):
        return topk_config_of(problem)

    def prepare_topk(self, problem, options: KernelOptions) -> HopperTopKRunner:
        return HopperTopKRunner(problem)

    def why_unsupported_selection_backward(self, problem, options: KernelOptions) -> list:
        return why_unsupported_selection_backward(problem)

    def selection_backward_cache_key(self, problem, options: KernelOptions):
        return backward_config_of(problem, options)

    def prepare_selection_backward(self, problem, options: KernelOptions) -> HopperSelectionBackwardRunner:
        return HopperSelectionBackwardRunner(problem, options)

    def why_unsupported_backward(self, problem: AttentionProblem, options: KernelOptions) -> list:
        return why_unsupported_backward(problem, options)

    def backward_cache_key(self, problem: AttentionProblem, options: KernelOptions):
        return HopperBackwardConfig.from_problem(problem, options)

    def prepare_backward(self, problem: AttentionProblem, options: KernelOptions) -> HopperBackwardRunner:
        cfg = HopperBackwardConfig.from_problem(problem, options)
        return HopperBackwardRunner(cfg, disk_cache.load_or_compile(cfg, compile_backward))
