"""Tier: pure (numpy). megatron_ext.replay.rollout_ingest: one sequence's tokens, loss mask and
per-token values, hand-worked (the module doc's example), and every refusal naming the record
(that the module never imports megatron: tests/replay/test_routes.py)."""

import numpy as np
import pytest

from megatron_ext.replay.rollout_ingest import (
    TokenKey,
    parse_token_keys,
    sequence_tokens,
    token_values,
)
from megatron_ext.replay.rollout_routes import RolloutDocument


def _doc(ids=(5, 6, 7, 8, 9), num_prompt=2, **fields) -> RolloutDocument:
    rows = np.zeros((0, 0, 0), dtype=np.int64)
    choice = {"advantages": [0.5, -1, 2], **fields}
    return RolloutDocument("f:1 choice 0", rows, len(ids), token_ids=list(ids),
                           num_prompt=num_prompt, fields=(choice, {"reward": 3}))  # fmt: skip


def test_the_worked_example():
    doc = _doc()
    tokens, mask = sequence_tokens(doc)
    assert tokens.dtype == np.int32 and tokens.tolist() == [5, 6, 7, 8, 9]
    assert mask.dtype == np.uint8 and mask.tolist() == [0, 0, 1, 1, 1]
    per_token = token_values(doc, TokenKey("advantages", "advantages", False), 5)
    assert per_token.dtype == np.float32 and per_token.tolist() == [0, 0, 0.5, -1, 2]
    # The response's per-sequence reward, broadcast to the completion (the choice has none).
    assert token_values(doc, TokenKey("r", "reward", True), 5).tolist() == [0, 0, 3, 3, 3]


def test_the_engines_logprob_objects():
    chat = {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0},
                        {"token": "c", "logprob": -2.0}]}  # fmt: skip
    completion = {"token_logprobs": [-0.5, -1.0, -2.0], "tokens": ["a", "b", "c"]}
    sglang = [[-0.5, 7, None], [-1.0, 8, None], [-2.0, 9, None]]
    key = TokenKey("logprobs", "logprobs", False)
    for value in (chat, completion, sglang):
        got = token_values(_doc(logprobs=value), key, 5).tolist()
        assert got == [0, 0, -0.5, -1.0, -2.0]


def test_parse_token_keys():
    assert parse_token_keys("advantages,logprobs=completion_logprobs", "--token-keys", False) == [
        TokenKey("advantages", "advantages", False),
        TokenKey("logprobs", "completion_logprobs", False),
    ]
    assert parse_token_keys(None, "--sequence-keys", True) == []
    for bad, match in (("a,,b", "not NAME"), ("loss_mask", "the tool's own"), ("x-y", "not NAME")):
        with pytest.raises(ValueError, match=f"--token-keys .*{match}"):
            parse_token_keys(bad, "--token-keys", False)


@pytest.mark.parametrize(
    "doc, key, match",
    [
        (_doc(advantages=[0.5, 1]), "advantages", r"f:1 choice 0 advantages: 2 values for the 3 "
                                                  r"completion tokens \(2 prompt tokens of 5\)"),
        (_doc(advantages=[0.5, float("nan"), 1]), "advantages", r"advantages\[1\] is nan"),
        (_doc(advantages=[0.5, float("inf"), 1]), "advantages", r"advantages\[1\] is inf"),
        (_doc(advantages=[0.5, True, 1]), "advantages", r"advantages\[1\] is True, not a finite"),
        (_doc(advantages=0.5), "advantages", r"a per-token key .* got float"),
        (_doc(), "nope", r"f:1 choice 0: has no 'nope'"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_record_and_key(doc, key, match):
    with pytest.raises(ValueError, match=match):
        token_values(doc, TokenKey(key, key, False), 5)


def test_a_per_sequence_key_holds_one_number():
    with pytest.raises(ValueError, match=r"advantages: a per-sequence key .* got a list"):
        token_values(_doc(), TokenKey("advantages", "advantages", True), 5)
    with pytest.raises(ValueError, match=r"reward is nan"):
        token_values(_doc(reward=float("nan")), TokenKey("reward", "reward", True), 5)


def test_sequences_without_ids_or_split_are_refused():
    with pytest.raises(ValueError, match="f:1 choice 0: carries no token ids"):
        sequence_tokens(RolloutDocument("f:1 choice 0", np.zeros((0, 0, 0)), 3))
    with pytest.raises(ValueError, match="does not tell its prompt from its completion"):
        sequence_tokens(_doc(num_prompt=None))
    for bad in ([1, True, 3], [1, 2.0, 3], [1, -1, 3], [1, 2**31, 3]):
        with pytest.raises(ValueError, match=r"token 1 is .*, not a token id \(int32\)"):
            sequence_tokens(_doc(ids=bad, num_prompt=1))
