"""A decode step that appends its rows (`k_new`/`v_new`) on the GPU: the append kernel
writes them into contiguous and paged caches at positions cache_seqlens[b]..., touching
nothing else, and the decode kernel attends over them, against the float64 reference; dense
and ragged query rows, one and several KV splits, the planned torch path on a second call,
and the torch operator in a CUDA graph."""
import numpy as np
import pytest

import mhadsl

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from test_gpu_decode import PROGRAM, cache, check  # noqa: E402

LENGTHS = [0, 700, 33, 1500]


def _step(rows, kv_heads=2, seed=3):
    """q, k_new, v_new and the ragged offsets (None: dense) of a step of `rows` query rows
    per sequence (0: ragged, 1, 3, 0 and 2 rows)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = [rows] * len(LENGTHS) if rows else [1, 3, 0, 2]
    lead = (len(LENGTHS), rows) if rows else (sum(per),)
    q, k_new, v_new = (torch.randn(*lead, h, 128, generator=g, device="cuda").to(torch.bfloat16)
                       for h in (8, kv_heads, kv_heads))
    cu = None if rows else torch.tensor(np.concatenate([[0], np.cumsum(per)]), dtype=torch.int32,
                                        device="cuda")
    return q, k_new, v_new, cu, per


def _written(cache_before, new, per, table, page_size):
    """What the cache holds once the new rows are written at positions LENGTHS[b]..."""
    want = cache_before.clone()
    rows = new.reshape(-1, *new.shape[-2:])
    i = 0
    for b, n in enumerate(per):
        for r in range(n):
            pos = LENGTHS[b] + r
            at = (b, pos) if table is None else (int(table[b, pos // page_size]), pos % page_size)
            want[at] = rows[i]
            i += 1
    return want


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("rows", [1, 4, 0])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_step_writes_its_rows_then_attends_over_them(page_size, rows, splits):
    kern = PROGRAM["causal"]
    k, v, _, table = cache([n + 16 for n in LENGTHS], 2, 128, page_size=page_size)
    seqlens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    q, k_new, v_new, cu, per = _step(rows)
    k_before, v_before = k.clone(), v.clone()
    check(kern, q, k, v, seqlens, table, cu_q=cu, max_q=None if rows else 3, lse=True,
          num_splits=splits, k_new=k_new, v_new=v_new)
    assert torch.equal(k, _written(k_before, k_new, per, table, page_size))
    assert torch.equal(v, _written(v_before, v_new, per, table, page_size))
    assert torch.equal(seqlens.cpu(), torch.tensor(LENGTHS, dtype=torch.int32))  # the caller's
    # a second step, on the planned path: the next rows after these
    seqlens += torch.tensor(per, dtype=torch.int32, device="cuda")
    q, k_new, v_new, cu, per = _step(rows, seed=4)
    check(kern, q, k, v, seqlens, table, cu_q=cu, max_q=None if rows else 3,
          num_splits=splits, k_new=k_new, v_new=v_new)


def test_rows_past_the_cache_on_the_device_are_not_written():
    kern = PROGRAM["causal"]
    k, v, _, _ = cache([64, 64], 2, 128)  # contiguous: 64 positions a sequence
    q, k_new, v_new = (torch.randn(2, 2, h, 128, device="cuda").to(torch.bfloat16)
                       for h in (8, 2, 2))
    k_before = k.clone()
    full = torch.tensor([63, 64], dtype=torch.int32, device="cuda")  # unchecked on the device
    out, _ = kern(q, k, v, cache_seqlens=full, k_new=k_new, v_new=v_new)  # (return_lse)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    assert torch.equal(k[0, 63], k_new[0, 0])  # sequence 0's last position: written
    k_before[0, 63] = k_new[0, 0]
    assert torch.equal(k, k_before)  # and nothing else: the rest lie past the cache
