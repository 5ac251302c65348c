"""``python -m hicache.kernels``: build (or find) the native CPU kernels and say which.
``--every-isa``: also build each other instruction set this CPU runs (the AVX2 build on an AVX-512
machine, which the tests compare against), one process each: a process loads one build only."""

import logging
import os
import subprocess
import sys

import torch

from hicache.kernels import ISA_ENV, build_dir, cpu_kernels, kernel_isa, unavailable_reason

if "--every-isa" in sys.argv[1:] and torch.backends.cpu.get_cpu_capability() == "AVX512" and kernel_isa() != "avx2":
    # the AVX2 build: the one other instruction set an AVX-512 CPU runs
    subprocess.run([sys.executable, "-m", "hicache.kernels"], env={**os.environ, ISA_ENV: "avx2"}, check=False)
logging.basicConfig(level=logging.INFO, format="%(message)s")
ops = cpu_kernels()
print(f"native CPU kernels: {f'{kernel_isa()} build ready in ' + str(build_dir()) if ops is not None else 'off (' + str(unavailable_reason() or 'build failed, see above') + ')'}")
