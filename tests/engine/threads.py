"""The suite runs with one OpenMP thread per pytest-xdist worker (`make test`); the kernels split rows,
tokens and heads over their threads, so their tests force an uneven split of three."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.kernels import CpuKernels

SPLIT_THREADS = 3


@contextmanager
def kernel_threads(*libraries: CpuKernels, n: int = SPLIT_THREADS) -> Iterator[None]:
    saved_torch = torch.get_num_threads()
    saved = [lib.num_threads for lib in libraries]
    torch.set_num_threads(n)
    for lib in libraries:
        lib.num_threads = n
    try:
        yield
    finally:
        torch.set_num_threads(saved_torch)
        for lib, threads in zip(libraries, saved):
            lib.num_threads = threads
