"""Runs ``megatron_ext.pretrain_gpt`` with one training-loop CPU patch left out (tests/cpu/test_training_loop.py).

python -m tests.cpu_loop_probe PATCH_NAME <pretrain_gpt flags>
"""

import functools
import sys

from megatron_ext.cpu import training_loop as cpu_loop


def main() -> int:
    skipped = sys.argv.pop(1)
    if skipped not in cpu_loop.PATCHES:
        raise SystemExit(f"unknown patch {skipped!r}; known: {sorted(cpu_loop.PATCHES)}")
    # main()'s own enable_cpu_training() must leave it out too.
    cpu_loop.enable_cpu_training = functools.partial(cpu_loop.enable_cpu_training, skip=(skipped,))
    from megatron_ext.pretrain_gpt import main as pretrain_main

    return pretrain_main()


if __name__ == "__main__":
    sys.exit(main())
