"""Tier: pure. How many rounds the alignment benchmark runs per token count.

The full run rounds every row up to whole Williams designs (each variant follows every other
equally often, as its notes say), and the few-token rows, the ones a shared machine's noise
moves most, run at least two; the quick run (CI) keeps its few rounds.
"""

from megatron_ext.bench import alignment_rows as b
from megatron_ext.bench.rounds import design_length


def test_every_row_runs_whole_designs_and_few_token_rows_at_least_two():
    assert design_length(15) == 30 and design_length(8) == 8
    assert b._rounds_for(48, 15, 15, True) == 60  # few tokens: two designs of 30
    assert b._rounds_for(b.FEW_TOKENS, 15, 8, True) == 16
    assert b._rounds_for(b.FEW_TOKENS + 1, 15, 15, True) == 30  # 15 rounded up to one design
    assert b._rounds_for(8192, 15, 8, True) == 16
    assert b._rounds_for(8192, 15, 5, True) == 20  # odd count: designs of 10
    assert b._rounds_for(48, 5, 15, False) == 5  # quick: as asked
