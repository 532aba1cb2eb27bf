"""Runs ``megatron_ext.pretrain_gpt`` with one training-loop CPU patch left out (tests/training/test_cpu_loop.py).

python -m tests.cpu_loop_probe PATCH_NAME <pretrain_gpt flags>
"""

import sys

from megatron_ext import cpu_loop


def main() -> int:
    skipped = sys.argv.pop(1)
    if skipped not in cpu_loop.PATCHES:
        raise SystemExit(f"unknown patch {skipped!r}; known: {sorted(cpu_loop.PATCHES)}")
    cpu_loop.enable_cpu_training(skip=(skipped,))
    cpu_loop._ENABLED.add(skipped)  # main()'s own enable_cpu_training() must not apply it either
    from megatron_ext.pretrain_gpt import main as pretrain_main

    return pretrain_main()


if __name__ == "__main__":
    sys.exit(main())
