"""One rollout sequence -> its training data: token ids, loss mask and per-token values (pure
numpy, never imports megatron).

``ingest-rollouts`` writes, per document the route readers return, the tokens, a loss mask
(completion tokens 1, prompt tokens 0: what ``--pack-loss-mask-suffix`` reads) and one float32
value per token for each key asked for (``--token-keys``: one per completion token;
``--sequence-keys``: one, broadcast to the completion). Prompt tokens hold 0::

    prompt [5 6], completion [7 8 9], advantages [0.5 -1 2]
    tokens     [5 6 7 8 9]
    loss_mask  [0 0 1 1 1]
    advantages [0 0 0.5 -1 2]

Legend: T tokens of a sequence, P prompt tokens, C completion tokens.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from megatron_ext.replay.rollout_routes import RolloutDocument

#: Sidecar names the tool writes itself (``--loss-mask-suffix`` / ``--route-suffix`` defaults).
RESERVED_NAMES = ("loss_mask", "routes")
#: Token ids are stored as int32 (Megatron's IndexedDataset dtype for vocabularies >= 65500).
TOKEN_DTYPE = np.int32
VALUE_DTYPE = np.float32


@dataclasses.dataclass(frozen=True)
class TokenKey:
    """One per-token sidecar: written at ``PREFIX_<name>`` from the records' ``key``."""

    name: str
    key: str
    per_sequence: bool
    """The record holds one number per sequence, broadcast to the completion's tokens."""


def parse_token_keys(text: str | None, flag: str, per_sequence: bool) -> list[TokenKey]:
    """``"advantages,logprobs=completion_logprobs"`` -> keys (``NAME=KEY``, or a key as its own
    name); ValueError naming ``flag`` for a malformed entry or a reserved name."""
    keys = []
    for part in (text or "").split(","):
        if not part.strip() and text is None:
            continue
        name, _, key = part.strip().partition("=")
        key = key or name
        if not name.isidentifier() or not key:
            raise ValueError(f"{flag} {text!r}: {part.strip()!r} is not NAME or NAME=KEY")
        if name in RESERVED_NAMES:
            raise ValueError(f"{flag} {text!r}: {name!r} is the tool's own sidecar name")
        keys.append(TokenKey(name, key, per_sequence))
    return keys


def sequence_tokens(doc: RolloutDocument) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens_T, loss_mask_T)`` of one sequence: int32 ids, uint8 1 on completion tokens
    (ValueError naming the record without ids, a prompt/completion split, or int32 ids)."""
    # Where the readers find the ids (read from the engines' released source): vLLM
    # prompt_token_ids (chat: response; completion: each choice) and each choice's token_ids
    # (entrypoints/openai/{completion,chat_completion}/protocol.py); SGLang /generate
    # prompt_token_ids + output_ids (managers/tokenizer_manager.py) or a sample's tokens split at
    # meta_info.prompt_tokens, OpenAI-compatible sglext.input_ids / output_ids or the choice's
    # (entrypoints/openai/protocol.py); records prompt_ids + completion_ids (prime-rl's
    # TrainingSample) or prompt_token_ids + completion_token_ids.
    if doc.token_ids is None:
        raise ValueError(
            f"{doc.name}: carries no token ids (vLLM: send return_token_ids: true; SGLang "
            "/generate: return_prompt_token_ids: true; records: prompt_ids + completion_ids)"
        )
    if doc.num_prompt is None:
        raise ValueError(
            f"{doc.name}: does not tell its prompt from its completion (records: prompt_ids + "
            "completion_ids, or prompt_token_ids + completion_token_ids): the loss mask needs it"
        )
    ids = doc.token_ids
    bad = next((i for i, v in enumerate(ids) if type(v) is not int or not 0 <= v < 2**31), None)
    if bad is not None:
        raise ValueError(f"{doc.name}: token {bad} is {ids[bad]!r}, not a token id (int32)")
    if not 0 <= doc.num_prompt <= len(ids):
        raise ValueError(f"{doc.name}: {doc.num_prompt} prompt tokens of {len(ids)} tokens")
    tokens_T = np.asarray(ids, dtype=TOKEN_DTYPE)
    mask_T = np.zeros(tokens_T.size, dtype=np.uint8)
    mask_T[doc.num_prompt :] = 1  # value i is for token i as a target, as the sidecar reads it
    return tokens_T, mask_T


def _lookup(doc: RolloutDocument, key: str) -> Any:
    # Most specific object first: a choice, then its response; an SGLang record, then meta_info.
    for fields in doc.fields:
        if isinstance(fields, dict) and fields.get(key) is not None:
            return fields[key]
    raise ValueError(
        f"{doc.name}: has no {key!r} (asked for by --token-keys / --sequence-keys; looked up in "
        "the choice, then the response or record and its meta_info)"
    )


def _numbers(value: Any) -> Any:
    """The per-token numbers of the engines' log-prob objects; anything else as it is."""
    if isinstance(value, dict) and isinstance(value.get("token_logprobs"), list):
        return value["token_logprobs"]  # vLLM CompletionLogProbs
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        return [c.get("logprob") if isinstance(c, dict) else c for c in value["content"]]  # chat
    if isinstance(value, list) and value and all(isinstance(v, list) and v for v in value):
        return [v[0] for v in value]  # SGLang output_token_logprobs [[logprob, id, text], ...]
    return value


def _check_number(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{where} is {value!r}, not a finite number")
    return float(value)


def token_values(doc: RolloutDocument, key: TokenKey, num_tokens: int) -> np.ndarray:
    """One sidecar document ``[T]`` float32: prompt tokens 0, the completion's values after.

    A per-token key holds a list, vLLM's ``logprobs`` object (a completion's ``token_logprobs``,
    a chat's ``content[i].logprob``) or SGLang's ``[[logprob, id, text], ...]``; every value a
    finite number (else ValueError naming the record and the key).
    """
    num_prompt = doc.num_prompt
    assert num_prompt is not None
    completion = num_tokens - num_prompt
    raw = _lookup(doc, key.key)
    where = f"{doc.name} {key.key}"
    values_T = np.zeros(num_tokens, dtype=VALUE_DTYPE)
    if key.per_sequence:
        if isinstance(raw, (list, dict)):
            raise ValueError(
                f"{where}: a per-sequence key (--sequence-keys) holds one number, got a "
                f"{type(raw).__name__} (per-token values are --token-keys)"
            )
        values_T[num_prompt:] = _check_number(raw, where)
        return values_T
    numbers = _numbers(raw)
    if not isinstance(numbers, list):
        raise ValueError(
            f"{where}: a per-token key (--token-keys) holds a list over the completion, got "
            f"{type(raw).__name__} (one number per sequence is --sequence-keys)"
        )
    if len(numbers) != completion:
        raise ValueError(
            f"{where}: {len(numbers)} values for the {completion} completion tokens "
            f"({num_prompt} prompt tokens of {num_tokens})"
        )
    values_T[num_prompt:] = [_check_number(v, f"{where}[{i}]") for i, v in enumerate(numbers)]
    return values_T
