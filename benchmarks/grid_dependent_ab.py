"""(lab script, run from the repository root on an H100/H200)
A/B: every sm_90a kernel launched grid-dependent (programmatic dependent launch) against
the same PTX launched plainly. Two Kernel objects per declaration: 'pdl' plans as main does,
'plain' plans with KernelBuild.grid_dependent patched False. us per call (medians)."""
import contextlib, random, sys
import torch
import mhadsl
from mhadsl.codegen import backends
from mhadsl.host.bench import time_side_by_side

SOURCE = open("examples/document_mask.mha").read().replace(
    'import "std/schedulers.mha"', "") + """
import "std/schedulers.mha"
attention decode { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
attention causal { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain { dtype = bf16  head_dim = 128 }
"""
progs = {"pdl": mhadsl.compile(SOURCE, name="pdl_a"), "plain": mhadsl.compile(SOURCE, name="pdl_b")}
PROP = backends.KernelBuild.grid_dependent


@contextlib.contextmanager
def mode(name):
    if name == "plain":
        backends.KernelBuild.grid_dependent = property(lambda s: False)
    try:
        yield
    finally:
        backends.KernelBuild.grid_dependent = PROP


def planned(name, fn):
    with mode(name):
        fn()  # plans made now keep the mode
    torch.cuda.synchronize()
    return fn


def report(label, t, per=1):
    us = {k: v.ms * 1e3 / per for k, v in t.items() if v is not None}
    print(f"| {label} | " + " | ".join(f"{k} {x:.1f}" for k, x in us.items())
          + f" | plain/pdl {us['plain'] / us['pdl']:.3f} |", flush=True)


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    return g.replay


def decode_rows():
    D, Hq, Hkv, page = 128, 32, 8, 64
    for label, lens_list, cap in (
            ("short B32 169-1056 keys", [random.Random(0).randint(128, 1024) + 32 for _ in range(32)], 1120),
            ("long B16 ~4k", [random.Random(0).randint(512, 4096) + 32 for _ in range(16)], 4160),
            ("B32 8192 keys", [8192] * 32, 8192)):
        B = len(lens_list)
        pages = -(-cap // page)
        table = torch.randperm(B * pages, device="cuda").reshape(B, pages).int()
        k, v = (torch.randn(B * pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
        kn, vn = (torch.randn(B, 1, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = torch.empty_like(q)
        fns, fns1 = {}, {}
        for name, p in progs.items():
            kern = p["decode"]
            def layers(kern=kern):
                for _ in range(8):
                    kern(q, k, v, cache_seqlens=lens, page_table=table, k_new=kn, v_new=vn, out=out)
            with mode(name):
                fns[name] = graph_of(layers)
            fns1[name] = planned(name, lambda kern=kern: kern(q, k, v, cache_seqlens=lens, page_table=table, out=out))
        report(f"decode+append x8 graph, {label}", time_side_by_side(torch, fns, rounds=5), per=8)
        report(f"decode alone (events), {label}", time_side_by_side(torch, fns1, rounds=5))


def backward_rows():
    for B, H, S, name in ((16, 16, 1024, "causal"), (8, 32, 512, "plain"), (4, 16, 4096, "causal")):
        q, k, v = (torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        fns = {}
        for m, p in progs.items():
            kern = p[name]
            out, lse = kern(q, k, v, return_lse=True)
            fns[m] = planned(m, lambda kern=kern, out=out, lse=lse: kern.backward(q, k, v, out, lse, dout))
        report(f"backward {name} B{B} H{H} S{S}", time_side_by_side(torch, fns, rounds=5))


def forward_rows():
    for B, H, S, name in ((8, 32, 512, "plain"), (16, 16, 1024, "plain"), (16, 16, 1024, "causal")):
        q, k, v = (torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fns = {m: planned(m, lambda kern=p[name]: kern(q, k, v)) for m, p in progs.items()}
        report(f"forward {name} B{B} H{H} S{S} (events)", time_side_by_side(torch, fns, rounds=5))
        fns = {}
        for m, p in progs.items():
            kern = p[name]
            def four(kern=kern):
                for _ in range(4):
                    kern(q, k, v)
            with mode(m):
                fns[m] = graph_of(four)
        report(f"forward {name} B{B} H{H} S{S} x4 graph", time_side_by_side(torch, fns, rounds=5), per=4)
    # ragged causal: tile index kernel (sm_80) then attention
    lengths = [random.Random(1).randint(64, 2048) for _ in range(16)]
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lengths)), dtype=torch.int32, device="cuda")
    T = sum(lengths)
    q, k, v = (torch.randn(T, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns = {m: planned(m, lambda kern=p["causal"]: kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                          max_seqlen_q=max(lengths), max_seqlen_k=max(lengths)))
           for m, p in progs.items()}
    report("forward ragged causal 16 seqs 64-2048", time_side_by_side(torch, fns, rounds=5))


def document_rows():
    rng = random.Random(2)
    ids, n, d = [], 0, 0
    while n < 16384:
        L = min(rng.randint(256, 4096), 16384 - n)
        ids += [d] * L; n += L; d += 1
    doc = torch.tensor([ids], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns, given = {}, {}
    for m, p in progs.items():
        kern = p["document_mask"]
        fns[m] = planned(m, lambda kern=kern: kern(q, k, v, doc=doc))
        classes = kern.block_classes(q, k, v, doc=doc)
        given[m] = planned(m, lambda kern=kern, c=classes: kern(q, k, v, doc=doc, block_classes=c))
    report("documents B1 S16384 classes per call", time_side_by_side(torch, fns, rounds=5))
    report("documents B1 S16384 classes given", time_side_by_side(torch, given, rounds=5))


print(torch.cuda.get_device_name(), flush=True)
for part in sys.argv[1:] or ["decode", "backward", "forward", "documents"]:
    try:
        {"decode": decode_rows, "backward": backward_rows, "forward": forward_rows,
         "documents": document_rows}[part]()
    except Exception as e:  # keep the other parts
        import traceback; traceback.print_exc()
