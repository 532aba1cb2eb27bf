"""``python -m tests.training.imports_probe ARGS``: runs ``python -m megatron_ext.pretrain_gpt ARGS`` and,
at interpreter exit, prints which optional heavy modules the launch imported (for test_startup.py)."""

import atexit
import runpy
import sys

WATCHED = ("transformers", "megatron.core.tokenizers.text.libraries.huggingface_tokenizer")


def _report() -> None:
    print("imported:", " ".join(f"{m}={m in sys.modules}" for m in WATCHED), flush=True)


if __name__ == "__main__":
    atexit.register(_report)
    sys.argv = ["megatron_ext.pretrain_gpt", *sys.argv[1:]]
    runpy.run_module("megatron_ext.pretrain_gpt", run_name="__main__", alter_sys=True)
