"""Where in a Megatron function a compatibility row's behaviour sits: its CUDA calls, or named lines.

A row fingerprints the narrowest span of Megatron's source that matters to it (docs/compat.md), so
an edit elsewhere in a 600-line ``train`` leaves it as it was. Example (a row of ``train`` rerouting ``torch.cuda.synchronize``, factories on ``"cuda"``)::

    x = compute(batch)                           # not in the span
    torch.cuda.synchronize()                     # in the span: a rerouted call
    flags = torch.tensor([1],
                         device="cuda")          # in the span, both lines: a "cuda" device

Pure Python (``re``, ``linecache``): nothing here imports Megatron or torch.
"""

import dis
import linecache
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass

#: A place code touches CUDA: ``torch.cuda.<name>``, a ``"cuda"`` / ``"cuda:N"`` device string,
#: a ``.cuda(`` method call.
CUDA = re.compile(r"torch\.cuda\.(\w+)|[\"']cuda[\"':]|\.cuda\(")


@dataclass(frozen=True)
class CudaUse:
    """One place a function touches CUDA.

    Attributes:
        name: The ``torch.cuda`` attribute (``"synchronize"``), ``'"cuda"'`` (a device string) or
            ``".cuda("`` (a module or tensor moved to the device).
        line: Its line in the file.
    """

    name: str
    line: int

    @property
    def label(self) -> str:
        """``torch.cuda.synchronize``, ``"cuda"`` or ``.cuda(``."""
        return f"torch.cuda.{self.name}" if self.name.isidentifier() else self.name

    def __str__(self) -> str:
        return f"{self.label} (line {self.line})"


def _last_line(code: types.CodeType) -> int:
    """The last source line of ``code`` and the code nested in it (closing brackets included)."""
    ends = [end for _, end, _, _ in code.co_positions() if end is not None]
    nested = [_last_line(c) for c in code.co_consts if isinstance(c, types.CodeType)]
    return max([code.co_firstlineno, *ends, *nested])


#: A function's first line in its file and its source lines.
Source = tuple[int, list[str]]


def function_lines(function: types.FunctionType) -> Source:
    """The first line of ``function`` in its file and its source lines (decorators included), read
    off its code object (no tokenizing)."""
    code = function.__code__
    linecache.checkcache(code.co_filename)  # one stat: a file edited since it was read
    first = code.co_firstlineno
    return first, linecache.getlines(code.co_filename)[first - 1 : _last_line(code)]


def _code_lines(lines: list[str], first: int) -> Iterator[tuple[int, str]]:
    """``(line number, code)`` of each line, its comment dropped."""
    # Crude but fast: a "#" inside a string cuts the line there too.
    for number, line in enumerate(lines, start=first):
        yield number, line.split("#")[0]


def cuda_uses(function: types.FunctionType, source: Source | None = None) -> list[CudaUse]:
    """Every place ``function`` (the functions nested in it included) touches CUDA, in order."""
    first, lines = source or function_lines(function)
    found = []
    for number, code in _code_lines(lines, first):
        for match in CUDA.finditer(code):
            # group(1) is the torch.cuda attribute; else a device string or a .cuda( call.
            name = match.group(1) or ('"cuda"' if match.group(0)[0] in "\"'" else ".cuda(")
            found.append(CudaUse(name, number))
    return found


def holding(source: Source, fragments: tuple[str, ...]) -> dict[str, list[int]]:
    """For each fragment, the lines of ``source`` whose code (comment dropped) contains it."""
    found: dict[str, list[int]] = {fragment: [] for fragment in fragments}
    for number, code in _code_lines(source[1], source[0]):
        for fragment in fragments:
            if fragment in code:
                found[fragment].append(number)
    return found


def lines_holding(function: types.FunctionType, fragments: tuple[str, ...]) -> dict[str, list[int]]:
    """For each fragment, the lines of ``function`` whose code (comment dropped) contains it."""
    return holding(function_lines(function), fragments)


#: The instructions whose position is an expression's extent: a call over several lines, a list,
#: tuple or dict literal. (A ``with`` block's exit call has the whole block's extent: see
#: :func:`_expressions`.)
_EXPRESSIONS = {
    dis.opmap[name]
    for name in (
        "CALL",
        "CALL_FUNCTION_EX",
        "BUILD_LIST",
        "BUILD_TUPLE",
        "BUILD_MAP",
        "BUILD_SET",
        "BUILD_CONST_KEY_MAP",
    )
}
#: A line that opens a block: an instruction starting there spans the block, not an expression.
_BLOCK = re.compile(
    r"\s*(with|async\s+with|for|async\s+for|while|if|elif|try|def|async\s+def|class)\b"
)


def _expressions(code: types.CodeType, lines: list[str], first: int) -> Iterator[tuple[int, int]]:
    """``(first, last)`` line of each call or literal in ``code`` and the code nested in it that
    spans more than one line (``lines``: the function's, from line ``first``), but for those
    starting on a block's opening line (a ``with``'s exit call spans the whole block)."""
    # One position per 2-byte code unit, as co_code is laid out.
    for op, (start, end, _, _) in zip(code.co_code[::2], code.co_positions(), strict=True):
        if op in _EXPRESSIONS and start is not None and end is not None and end > start:
            if not _BLOCK.match(lines[start - first]):
                yield start, end
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _expressions(const, lines, first)


def statements_at(
    function: types.FunctionType, lines: set[int], source: Source | None = None
) -> list[tuple[int, int]]:
    """The line ranges of ``function``'s code at ``lines``: each line widened to the widest call
    or literal over it (a call whose arguments take several lines)."""
    # Read off the code object's instruction positions, not by parsing: a launch reads the spans
    # of ~100 functions in milliseconds.
    first, text = source or function_lines(function)
    multi = list(_expressions(function.__code__, text, first)) if lines else []
    spans = set()
    for line in lines:
        # The widest expression over the line: a call's arguments may hold nested calls.
        over = [(a, b) for a, b in multi if a <= line <= b]
        spans.add((min(a for a, _ in over), max(b for _, b in over)) if over else (line, line))
    return sorted(spans)


def cuda_span(function: types.FunctionType) -> list[tuple[int, int]]:
    """The statements of ``function`` that touch CUDA: what a ``HostTorch`` row fingerprints."""
    source = function_lines(function)
    return statements_at(function, {use.line for use in cuda_uses(function, source)}, source)


def fragment_span(
    function: types.FunctionType, fragments: tuple[str, ...]
) -> list[tuple[int, int]]:
    """The statements of ``function`` holding ``fragments``: what a row depending on them
    fingerprints."""
    source = function_lines(function)
    held = holding(source, fragments).values()
    return statements_at(function, {line for found in held for line in found}, source)


def span_text(function: types.FunctionType, spans: list[tuple[int, int]]) -> list[str]:
    """The source lines of ``spans`` (line numbers of ``function``'s file)."""
    lines = linecache.getlines(function.__code__.co_filename)
    return [line for first, last in spans for line in lines[first - 1 : last]]
