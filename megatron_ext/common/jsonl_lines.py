"""Reading JSONL lines strictly, shared by the token preprocessor and the route converter.

Both tools read files line by line (memory holds one line) and refuse the same bad input the same
way: a line that is not UTF-8 is named, never decoded with replacement characters; a blank line is
skipped; a JSON object that gives a key twice is refused (``json.loads`` would keep its last value
and drop the other silently)::

    decode_line(b'{"text": "a"}\\n', "in.jsonl line 1")  -> '{"text": "a"}\\n'
    decode_line(b"  \\n", "in.jsonl line 2")             -> None   (blank: skipped)
    decode_line(b"\\xff\\n", "in.jsonl line 3")           -> ValueError "in.jsonl line 3: not UTF-8 ..."
"""

from typing import Any


def decode_line(raw: bytes, where: str) -> str | None:
    """One raw line as text, or None when it is blank.

    Args:
        raw: The line's bytes, as iterating a file opened in binary mode gives them.
        where: How messages name the line (``"file:7"``, ``"file line 7"``).

    Raises:
        ValueError: The line is not UTF-8, naming it.
    """
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 ({err.reason})") from err
    return line if line.strip() else None


def refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads`` object hook: a key given twice would silently keep only its last value.

    Raises:
        ValueError: Naming the key.
    """
    record = dict(pairs)
    if len(record) != len(pairs):
        keys = [key for key, _ in pairs]
        dup = next(key for i, key in enumerate(keys) if key in keys[:i])
        raise ValueError(f"key {dup!r} appears twice (only one of its values would be kept)")
    return record
