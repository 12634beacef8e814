"""Decode against a float8_e4m3fn KV cache on the GPU, against the float64
`mhadsl.reference_decode` on the dequantised cache: contiguous and paged caches, head dims
64/128/256, GQA 1 and 4, 1/4/16 query rows and ragged rows, one and three KV splits, a score
rule, the fused append (its rows stored byte for byte as the reference rounds them), and the
host checks of the cache's dtype and scales."""
import numpy as np
import pytest

import mhadsl
from mhadsl.analysis.reference import e4m3_bytes

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from test_gpu_decode import PROGRAM, cache, check  # noqa: E402

SCALES = dict(k_scale=0.07, v_scale=1.5)


def fp8_cache(lengths, hkv, d, page_size=None, seed=0):
    """`cache`'s tensors with K and V in float8_e4m3fn (N(0, 1) elements)."""
    k, v, seqlens, table = cache(lengths, hkv, d, page_size=page_size, seed=seed)
    return k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), seqlens, table


@pytest.mark.parametrize("name, d", [("causal", 128), ("causal_d64", 64),
                                     ("causal_d256", 256)])
@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_an_fp8_cache_matches_the_dequantised_reference(name, d, page_size):
    lengths = [1, 2, 63, 64, 65, 700, 2049]
    k, v, seqlens, table = fp8_cache(lengths, 2, d, page_size)
    q = torch.randn(len(lengths), 1, 8, d, device="cuda").to(torch.bfloat16)
    check(PROGRAM[name], q, k, v, seqlens, table, **SCALES)
    check(PROGRAM[name], q, k, v, seqlens, table, num_splits=3, **SCALES)


@pytest.mark.parametrize("rows, heads, kv_heads", [(4, 8, 8), (16, 8, 2), (0, 16, 4)])
@pytest.mark.parametrize("kernel", ["causal", "softcap"])
def test_fp8_query_rows_gqa_and_scores(rows, heads, kv_heads, kernel):
    lengths = [40, 700, 1500]
    k, v, seqlens, table = fp8_cache(lengths, kv_heads, 128, page_size=64)
    per = [rows] * 3 if rows else [1, 7, 30]
    lead = (3, rows) if rows else (sum(per),)
    q = torch.randn(*lead, heads, 128, device="cuda").to(torch.bfloat16)
    cu = None if rows else torch.tensor(np.concatenate([[0], np.cumsum(per)]),
                                        dtype=torch.int32, device="cuda")
    for splits in (1, 3):
        check(PROGRAM[kernel], q, k, v, seqlens, table, cu_q=cu, max_q=None if rows else 30,
              lse=True, num_splits=splits, **SCALES)


@pytest.mark.parametrize("page_size", [None, 16])
def test_the_append_stores_rows_quantised_as_the_reference_rounds_them(page_size):
    lengths = [0, 700, 14, 1500]  # 14 + 4 rows cross a 16-row page
    k, v, _, table = fp8_cache([n + 16 for n in lengths], 2, 128, page_size)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(4, 4, 8, 128, device="cuda").to(torch.bfloat16)
    k_new, v_new = (torch.randn(4, 4, 2, 128, device="cuda").to(torch.bfloat16) * 20
                    for _ in range(2))
    k_before = k.clone()
    ref = mhadsl.reference_decode(PROGRAM["causal"], q, k, v, cache_seqlens=seqlens,
                                  page_table=table, k_new=k_new, v_new=v_new, **SCALES)
    out, _ = PROGRAM["causal"](q, k, v, cache_seqlens=seqlens, page_table=table, k_new=k_new,
                              v_new=v_new, **SCALES)
    err = np.linalg.norm(out.float().cpu().numpy() - ref[0]) / np.linalg.norm(ref[0])
    assert err < 2e-2, err
    written = k_before.view(torch.uint8).clone()
    for b, n in enumerate(lengths):
        for r in range(4):
            pos = n + r
            at = (b, pos) if table is None else (int(table[b, pos // 16]), pos % 16)
            written[at] = torch.from_numpy(e4m3_bytes(
                k_new[b, r].float().cpu().numpy() / np.float32(SCALES["k_scale"])))
    assert torch.equal(k.view(torch.uint8).cpu(), written.cpu())  # and nothing else changed


def test_an_fp8_cache_is_checked():
    k, v, seqlens, _ = fp8_cache([8, 8], 2, 128)
    q = torch.randn(2, 1, 8, 128, device="cuda").to(torch.bfloat16)
    kern = PROGRAM["causal"]
    with pytest.raises(TypeError, match="both be float8_e4m3fn or neither"):
        kern(q, k, v.to(torch.bfloat16), cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="k_scale must be finite and above 0"):
        kern(q, k, v, cache_seqlens=seqlens, k_scale=0.0)
    with pytest.raises(ValueError, match="dequantise a float8_e4m3fn cache"):
        kern(q, k.to(torch.bfloat16), v.to(torch.bfloat16), cache_seqlens=seqlens,
             v_scale=2.0)

