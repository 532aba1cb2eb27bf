"""Reading JSONL lines strictly, shared by the token preprocessor and the route converter: a line
that is not UTF-8 is named (never decoded with replacement characters), a blank line skipped, a key
given twice refused::

    decode_line(b'{"text": "a"}\n', "in.jsonl line 1")  -> '{"text": "a"}\n'
    decode_line(b"  \n", "in.jsonl line 2")             -> None   (blank: skipped)
    decode_line(b"\xff\n", "in.jsonl line 3")           -> ValueError "in.jsonl line 3: not UTF-8 ..."
"""

from typing import Any


def decode_line(raw: bytes, where: str) -> str | None:
    """One raw line (bytes) as text, or None when it is blank; ValueError naming it (``where``:
    ``"file:7"``, ``"file line 7"``) when it is not UTF-8."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 ({err.reason})") from err
    return line if line.strip() else None


def refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads`` object hook refusing (ValueError naming it) a key given twice."""
    # json.loads would keep its last value and drop the other silently.
    record = dict(pairs)
    if len(record) != len(pairs):
        keys = [key for key, _ in pairs]
        dup = next(key for i, key in enumerate(keys) if key in keys[:i])
        raise ValueError(f"key {dup!r} appears twice (only one of its values would be kept)")
    return record
