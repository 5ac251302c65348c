"""``python -m hicache.kernels``: build (or find) the native CPU kernels and say which."""

import logging
import sys

from hicache.kernels import build_dir, cpu_kernels, kernel_isa, unavailable_reason

logging.basicConfig(level=logging.INFO, format="%(message)s")
ops = cpu_kernels()
print(f"native CPU kernels: {f'{kernel_isa()} build ready in ' + str(build_dir()) if ops is not None else 'off (' + str(unavailable_reason() or 'build failed, see above') + ')'}")
sys.exit(0)
