"""Shared pytest setup: keep Megatron's jit fusers from compiling on CPU and fix thread counts."""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
