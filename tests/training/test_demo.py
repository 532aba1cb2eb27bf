"""Tier: gloo ranks. The CPU main job trains the real tiny MoE GPTModel at EP=2 and reports loads."""

import argparse
import json

from megatron_ext.training.demo import main


def test_demo_trains_and_reports_tokens_per_ep_rank(tmp_path, capsys) -> None:
    out = tmp_path / "demo.json"
    assert main(argparse.Namespace(steps=3, json=str(out))) == 0
    history = json.loads(out.read_text())["history"]
    assert len(history) == 3
    assert history[-1]["loss"] < history[0]["loss"]  # AdamW at lr 3e-3 learns bytes within 3 steps
    for entry in history:
        per_rank = entry["tokens_per_ep_rank"]  # [layers][ep ranks]
        assert len(per_rank) == 2 and all(len(layer) == 2 for layer in per_rank)
        assert all(sum(layer) == 2 * 4 * 128 * 2 for layer in per_rank)  # ranks x batch x seq x top-2
    assert "tokens per EP rank" in capsys.readouterr().out
