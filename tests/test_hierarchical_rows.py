"""The hierarchical backend's row moves (backends/hierarchical/rows.py) move whole rows bit for bit,
whatever the dtype, row width or address, seen as machine words or not."""
import pytest
import torch

from ep_plugin.backends.hierarchical.rows import as_words, gather_rows, scatter_rows

CASES = [(torch.bfloat16, 7168), (torch.float8_e4m3fn, 7168), (torch.bfloat16, 7), (torch.float32, 56),
         (torch.int64, 8), (torch.bfloat16, 3), (torch.float8_e4m3fn, 3), (torch.float32, 1)]


def _bytes_of_rows(t):  # an independent reference: the rows' raw bytes, one Python list per row
    return [bytes(t[i].contiguous().view(torch.uint8).tolist()) for i in range(t.shape[0])]


@pytest.mark.parametrize("dtype,width", CASES)
@pytest.mark.parametrize("rows", [0, 1, 9])
def test_rows_move_bit_for_bit(dtype, width, rows):
    g = torch.Generator().manual_seed(rows * 31 + width)
    t = (torch.randn(rows, width, generator=g) * 100).to(dtype)
    perm = torch.randperm(rows, generator=g)
    src = _bytes_of_rows(t)
    out = scatter_rows(t, perm)
    assert out.dtype == dtype and out.shape == t.shape
    got = _bytes_of_rows(out)
    for i in range(rows):
        assert got[int(perm[i])] == src[i]
    picked = torch.randint(0, max(rows, 1), (5,), generator=g) if rows else perm
    back = gather_rows(t, picked)
    assert back.dtype == dtype and back.shape == (picked.numel(), width)
    assert _bytes_of_rows(back) == [src[int(j)] for j in picked]


def test_words_are_the_widest_that_fit():
    assert as_words(torch.zeros(4, 7168, dtype=torch.bfloat16)).dtype == torch.int64
    assert as_words(torch.zeros(4, 7168 + 2, dtype=torch.bfloat16)).dtype == torch.int32
    assert as_words(torch.zeros(4, 7168 + 1, dtype=torch.bfloat16)).dtype == torch.bfloat16  # itself
    assert as_words(torch.zeros(4, 3, dtype=torch.float8_e4m3fn)).dtype == torch.uint8  # FP8: always words
    short = torch.zeros(4, 56)  # scales: short rows keep their dtype (no host op for a view)
    assert as_words(short) is short
    ids = torch.zeros(4, 8, dtype=torch.int64)
    assert as_words(ids) is ids
    odd = torch.zeros(11 * 1024, dtype=torch.bfloat16)[1:1025].view(2, 512)  # an address 2 bytes past a word
    assert as_words(odd).dtype == torch.bfloat16
    assert as_words(torch.zeros(8, 4).t()).shape == (4, 8)  # not contiguous: itself
    assert gather_rows(None, torch.zeros(1, dtype=torch.long)) is None and scatter_rows(None, None) is None
