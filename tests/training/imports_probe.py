"""``python -m tests.training.imports_probe ARGS``: runs ``python -m megatron_ext.pretrain_gpt ARGS`` and,
at interpreter exit, prints which optional heavy modules the launch imported; also, as each
``torch.utils.data.DataLoader`` is built, its number of worker processes (for test_startup.py)."""

import atexit
import runpy
import sys

WATCHED = ("transformers", "megatron.core.tokenizers.text.libraries.huggingface_tokenizer")


def _report() -> None:
    print("imported:", " ".join(f"{m}={m in sys.modules}" for m in WATCHED), flush=True)


def _report_dataloader_workers() -> None:
    import torch.utils.data

    build = torch.utils.data.DataLoader.__init__

    def reporting(self, *args, **kwargs) -> None:
        build(self, *args, **kwargs)
        print(f"dataloader workers: {self.num_workers}", flush=True)

    torch.utils.data.DataLoader.__init__ = reporting


if __name__ == "__main__":
    atexit.register(_report)
    _report_dataloader_workers()
    sys.argv = ["megatron_ext.pretrain_gpt", *sys.argv[1:]]
    runpy.run_module("megatron_ext.pretrain_gpt", run_name="__main__", alter_sys=True)
