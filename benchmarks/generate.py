"""Benchmark: the token-generation loop of `examples/generate.py`, side by side in one process
with the same model on torch SDPA and, where installed, FlashAttention.

    python3 benchmarks/generate.py                    # both workloads
    python3 benchmarks/generate.py --workload long    # one of them
    python3 benchmarks/generate.py --json FILE        # and the rows in results.json's format

The model is `examples/generate.py`'s (random weights; GQA attention, RMSNorm, a SiLU MLP)
with Qwen3-4B-like layer shapes: hidden 2560, 32 query and 8 K/V heads of 128, MLP 10240,
vocabulary 4096, 8 layers unless `--layers` says otherwise. A ragged batch of prompts
(`WORKLOADS`: lengths drawn uniformly, seeded) is prefilled once, by mhadsl into the
example's paged cache (pages of 64 rows in random order); every column starts from a copy
of that cache and the same first token and runs `--steps` greedy decode steps, each a
`torch.compile(mode="reduce-overhead", fullgraph=True)` step (a CUDA-graph replay) that
writes its token's K/V rows into the column's cache and attends over it:

- mhadsl: the example's own compiled step (`prefill` in `examples/generate.py`): the decode
  operator, the rows appended by the same call (`k_new`/`v_new`), on the paged cache;
- torch SDPA: a contiguous cache (B, Hkv, capacity, D), the rows written by index_put, and
  `scaled_dot_product_attention` over the whole capacity with a boolean mask of each
  sequence's length (the static-cache way; torch picks the backend); a K/V head's query
  heads are its query rows, so each K/V row is read once;
- FlashAttention-4 (`flash_attn.cute.flash_attn_varlen_func`, which has no append): the rows
  written by index_put into a copy of the same pages (else a contiguous cache), then its
  varlen entry with `page_table` (if paged) and `seqused_k`;
- FlashAttention-3 (`flash_attn_interface`) and FlashAttention-2 (`flash_attn`):
  `flash_attn_with_kvcache` with its own append (`k=`, `v=`, `cache_seqlens`), FA3 on the
  pages (else contiguous), FA2 on a contiguous cache (its pages must be multiples of 256).

Each peer is first called once outside the model against mhadsl's kernel on the same cache
(relative error < 1e-2), which picks its form; FlashAttention runs as a torch custom
operator so that torch.compile captures it. A column that torch.compile cannot capture runs
its step eagerly, and says so. Columns are timed in turn over rounds
(`mhadsl.host.bench.time_side_by_side`: `--steps` steps between two CUDA events, medians):
tokens/s (batch x steps over that time) and ms per step.

Correctness: every column's tokens must pass `examples/generate.py`'s check (each token the
greedy choice of the model run over the whole text with torch's attention, up to a near tie:
top-2 logits within 5 %); a peer that fails is not timed. Exact equality with mhadsl's tokens
is not required (bf16 rounding can flip a near tie, and a flipped token changes the rest of
its sequence); the table reports it instead: the steps for which every sequence's token
equals mhadsl's, and the share of equal tokens. `--json FILE` writes one row a workload in
`benchmarks/results.json`'s row format, of kind `KIND` (add it to the file's kinds).
"""
import argparse
import datetime
import importlib.util
import json
import random
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HIDDEN, HEADS, KV_HEADS, LAYERS = 2560, 32, 8, 8
WORKLOADS = {  # name: (batch, shortest prompt, longest prompt)
    "long": (16, 512, 4096),
    "short": (32, 128, 1024),
}
STEPS = 128
NAMES = {"sdpa": "torch SDPA", "fa4": "FlashAttention-4", "fa3": "FlashAttention-3",
         "fa2": "FlashAttention-2"}
KIND = {"id": "generate", "title": "Token generation", "unit": "tokens/s", "better": "higher",
        "digits": 0, "ours": "mhadsl",
        "intro": "Greedy decode steps of `examples/generate.py`'s model (random weights), each "
                 "step a CUDA-graph replay of the torch.compile'd model that appends its K/V "
                 "rows and attends over the cache; tokens/s = batch × steps over the steps' "
                 "median time. Only the attention and its cache differ between columns."}
NOTES = ["One prefill (mhadsl's) and one first token for every column; each column's step "
         "compiled with `mode=\"reduce-overhead\"` unless the detail says otherwise. torch "
         "SDPA attends over a contiguous cache of the longest prompt plus the steps, with a "
         "boolean mask of the lengths; FlashAttention-4 has no append (index_put writes the "
         "rows); FlashAttention-3/2 append with `flash_attn_with_kvcache`. Every column's "
         "tokens pass `examples/generate.py`'s check."]


def load_example(hidden: int, heads: int, kv_heads: int):
    """`examples/generate.py` as a module, its model's shapes set to these."""
    spec = importlib.util.spec_from_file_location("generate_example",
                                                  REPO / "examples" / "generate.py")
    ex = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ex  # torch.compile imports the model's module by its name
    spec.loader.exec_module(ex)
    ex.HIDDEN, ex.HEADS, ex.KV_HEADS = hidden, heads, kv_heads
    return ex


def prompt_lengths(batch: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(shortest, longest) for _ in range(batch)]


class Column:
    """One way of running the decode step: `step(tokens) -> next tokens` writes the step's
    rows into the column's cache and advances `lengths`; `how` says what attends, `mode`
    how the step runs (CUDA graphs, unless it says otherwise)."""

    def __init__(self, name: str, step, lengths, how: str, mode: str = ""):
        self.name, self.step, self.lengths, self.how, self.mode = name, step, lengths, how, mode


class Workload:
    """A prefilled batch: the example module, the model, the prompts, mhadsl's cache and
    compiled step, the first token and the lengths every column starts from."""

    def __init__(self, torch, ex, model, lengths: list[int], steps: int):
        import mhadsl
        self.torch, self.ex, self.model, self.steps = torch, ex, model, steps
        g = torch.Generator(device="cuda").manual_seed(1)
        self.prompts = [torch.randint(ex.VOCAB, (n,), generator=g, device="cuda")
                        for n in lengths]
        self.cache, self.first, self.mhadsl_step = ex.prefill(model, self.prompts,
                                                             max(lengths) + steps)
        self.start = self.cache.lengths.clone()
        self.batch = len(lengths)
        self.capacity = self.cache.page_table.shape[1] * ex.PAGE  # keys a contiguous copy holds
        self.kern = mhadsl.compile(ex.STEP)["step"]

    def generation(self, column: Column) -> list:
        """The column's `steps` tokens after the first, from the prefilled lengths."""
        column.lengths.copy_(self.start)
        return self.ex.decode_loop(column.step, self.first, self.steps)

    def check(self, tokens: list) -> int:
        """Tokens that torch's attention over each whole text predicts otherwise."""
        generated = self.torch.stack([self.first, *tokens], 1)
        texts = [self.torch.cat([p, g]) for p, g in zip(self.prompts, generated)]
        return self.ex.check(self.model, texts, self.steps + 1)

    def own_lengths(self):
        lengths = self.start.clone()
        self.torch._dynamo.mark_static_address(lengths)
        return lengths

    def paged_copy(self):
        """Each layer's K and V pages, copied: ([k per layer], [v per layer])."""
        ks = [x.clone() for x in self.cache.k]
        vs = [x.clone() for x in self.cache.v]
        return self._static(ks, vs)

    def contiguous_copy(self, heads_first: bool = False):
        """Each layer's K and V gathered from the pages, (B, capacity, Hkv, D) each, or
        (B, Hkv, capacity, D) with `heads_first`."""
        table = self.cache.page_table.long()

        def gather(x):
            y = x[table].flatten(1, 2)
            return (y.transpose(1, 2) if heads_first else y).contiguous()
        return self._static([gather(x) for x in self.cache.k], [gather(x) for x in self.cache.v])

    def _static(self, ks, vs):
        for t in (*ks, *vs):  # written by the captured step: their addresses must not move
            self.torch._dynamo.mark_static_address(t)
        return ks, vs

    def probe_q(self):
        g = self.torch.Generator(device="cuda").manual_seed(3)
        return self.torch.randn(self.batch, 1, self.ex.HEADS, self.ex.HEAD_DIM, device="cuda",
                                dtype=self.torch.bfloat16, generator=g)

    def reference(self, q):
        """mhadsl's kernel on layer 0 of the prefilled cache (no append)."""
        return self.kern(q, self.cache.k[0], self.cache.v[0], cache_seqlens=self.start,
                         page_table=self.cache.page_table)


def compiled_step(torch, model, lengths, attention, mode: str, tag: str):
    """The decode step of `model` whose layers attend with `attention(lengths)` (an
    `attend(layer, q, k, v)` for a step whose new rows go at positions `lengths`), then
    advance `lengths`; under torch.compile unless `mode` is "eager"."""
    def one_step(token):
        logits = model(token[:, None], attention(lengths))[:, 0]
        lengths.add_(1)
        return logits.argmax(-1)
    if mode == "eager":
        return one_step
    # a code object of its own: torch.compile keeps compiled code and guards per code object
    code = one_step.__code__.replace(co_name=f"one_step_{tag}")
    fresh = types.FunctionType(code, one_step.__globals__, code.co_name, None,
                               one_step.__closure__)
    return torch.compile(fresh, mode=mode, fullgraph=True)


def cudagraph_skips(torch) -> int:
    """How many graphs Inductor has compiled without CUDA graphs so far (0 where this torch
    does not count them)."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001 (a torch without the counter)
        return 0


def first_generation(torch, w, column) -> list:
    """The column's first generation (compiling and capturing its step); its `how` notes a
    step that Inductor compiled without CUDA graphs."""
    skips = cudagraph_skips(torch)
    tokens = w.generation(column)
    torch.cuda.synchronize()
    if cudagraph_skips(torch) > skips:
        column.mode = "compiled without CUDA graphs"
    return tokens


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0][:120] if text else "") or type(err).__name__


def relative_error(got, ref) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


# ----------------------------------------------------------------------------- the peers


def sdpa_peer(torch, w: Workload):
    """(how, make_attention): torch SDPA over a contiguous cache with a length mask."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    B, H, Hkv, D, cap = w.batch, w.ex.HEADS, w.ex.KV_HEADS, w.ex.HEAD_DIM, w.capacity
    G = H // Hkv
    ks, vs = w.contiguous_copy(heads_first=True)

    def attention(lengths):
        pos = lengths.long()
        rows = torch.arange(B, device="cuda")
        keep = (torch.arange(cap, device="cuda")[None, :] <= pos[:, None])[:, None, None, :]

        def attend(i, q, k, v):
            ks[i][rows, :, pos] = k[:, 0]
            vs[i][rows, :, pos] = v[:, 0]
            return sdpa(q.reshape(B, Hkv, G, D), ks[i], vs[i], attn_mask=keep).reshape(
                B, 1, H, D)
        return attend

    q = w.probe_q()
    keep = (torch.arange(cap, device="cuda")[None, :] < w.start[:, None].long())[:, None, None]
    ref = w.reference(q)
    err = relative_error(sdpa(q.reshape(B, Hkv, G, D), ks[0], vs[0], attn_mask=keep)
                         .reshape(B, 1, H, D), ref)
    if not err < 1e-2:
        print(f"  (torch SDPA differs from mhadsl's kernel: relative error {err:.3g}; "
              f"not timed)")
        return None
    backends = sdpa_backends(torch, lambda: sdpa(q.reshape(B, Hkv, G, D), ks[0], vs[0],
                                                 attn_mask=keep))
    return (f"index_put + SDPA, bool mask over {cap} keys, contiguous; backends that take "
            f"it: {backends}", attention)


def sdpa_backends(torch, call) -> str:
    import warnings
    from torch.nn.attention import SDPBackend, sdpa_kernel
    names = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call()
            names.append(backend.name.lower().replace("_attention", ""))
        except Exception:  # noqa: BLE001 (a backend that does not take the call)
            pass
    return ", ".join(names) or "none"


_OPS: dict = {}


def fa4_op(torch):
    """FlashAttention-4's varlen entry as a torch operator (None where not installed)."""
    if "fa4" in _OPS:
        return _OPS["fa4"]
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 (not installed, or does not load: no column)
        _OPS["fa4"] = None
        return None
    from typing import Optional

    @torch.library.custom_op("mhadsl_generate_bench::fa4", mutates_args=())
    def fa4(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            seqused_k: torch.Tensor, page_table: Optional[torch.Tensor], max_seqlen_k: int,
            num_splits: int) -> torch.Tensor:
        out = flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=seqused_k,
                                     page_table=page_table, max_seqlen_q=1,
                                     max_seqlen_k=max_seqlen_k, num_splits=num_splits,
                                     causal=True)
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(q.shape).contiguous()

    @fa4.register_fake
    def _(q, k_cache, v_cache, seqused_k, page_table, max_seqlen_k, num_splits):
        return q.new_empty(q.shape)
    _OPS["fa4"] = fa4
    return fa4


def fa4_peer(torch, w: Workload):
    """(how, make_attention) of FlashAttention-4: the first form (paged, else contiguous;
    num_splits 0, its heuristic, else 1) that runs and matches mhadsl's kernel."""
    op = fa4_op(torch)
    if op is None:
        return None
    q = w.probe_q()
    ref = w.reference(q)
    for form in ("paged", "contiguous"):
        ks, vs = w.paged_copy() if form == "paged" else w.contiguous_copy()
        table = w.cache.page_table if form == "paged" else None
        for splits in (0, 1):
            try:
                err = relative_error(op(q, ks[0], vs[0], w.start, table, w.capacity, splits),
                                     ref)
            except Exception as e:  # noqa: BLE001 (an assertion, a compile error: next form)
                print(f"  (FlashAttention-4 {form}, num_splits={splits}: {first_line(e)})")
                continue
            if err < 1e-2:
                return (f"index_put + varlen entry, {form}, num_splits={splits}",
                        fa4_attention(torch, w, op, ks, vs, table, splits))
            print(f"  (FlashAttention-4 {form}, num_splits={splits} differs from mhadsl's "
                  f"kernel: relative error {err:.3g})")
        del ks, vs
    return None


def fa4_attention(torch, w: Workload, op, ks, vs, table, splits: int):
    B, page, cap = w.batch, w.ex.PAGE, w.capacity

    def attention(lengths):
        pos = lengths.long()
        rows = torch.arange(B, device="cuda")
        at = (table[rows, pos // page].long(), pos % page) if table is not None else (rows, pos)
        used = lengths + 1

        def attend(i, q, k, v):
            ks[i][at] = k[:, 0]
            vs[i][at] = v[:, 0]
            return op(q, ks[i], vs[i], used, table, cap, splits)
        return attend
    return attention


def kvcache_fn(which: str):
    """`flash_attn_with_kvcache` of FlashAttention-3 or -2, as fn(q, k_cache, v_cache, k, v,
    cache_seqlens, page_table); None where not installed."""
    modules = {"fa3": ("flash_attn_interface", "flash_attn_3.flash_attn_interface"),
               "fa2": ("flash_attn",)}[which]
    for name in modules:
        try:
            lib = importlib.import_module(name)
            fn = lib.flash_attn_with_kvcache
        except Exception:  # noqa: BLE001 (not installed, or does not load)
            continue
        table_kw = "page_table" if which == "fa3" else "block_table"

        def call(q, k_cache, v_cache, k, v, cache_seqlens, page_table, fn=fn, kw=table_kw):
            out = fn(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, causal=True,
                     **({kw: page_table} if page_table is not None else {}))
            return out[0] if isinstance(out, tuple) else out
        return call
    return None


def kvcache_op(torch, which: str, call):
    """`call` as a torch operator that writes the caches."""
    if which in _OPS:
        return _OPS[which]
    from typing import Optional

    @torch.library.custom_op(f"mhadsl_generate_bench::{which}_kvcache",
                             mutates_args=("k_cache", "v_cache"))
    def op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, cache_seqlens: torch.Tensor,
           page_table: Optional[torch.Tensor]) -> torch.Tensor:
        return call(q, k_cache, v_cache, k, v, cache_seqlens, page_table).reshape(
            q.shape).contiguous()

    @op.register_fake
    def _(q, k_cache, v_cache, k, v, cache_seqlens, page_table):
        return q.new_empty(q.shape)
    _OPS[which] = op
    return op


def kvcache_peer(torch, w: Workload, which: str):
    """(how, make_attention) of FlashAttention-3 or -2's `flash_attn_with_kvcache`: the
    first form (FA3: paged, else contiguous; FA2: contiguous) that matches mhadsl's
    kernel."""
    call = kvcache_fn(which)
    if call is None:
        return None
    q = w.probe_q()
    ref = w.reference(q)
    for form in (("paged", "contiguous") if which == "fa3" else ("contiguous",)):
        ks, vs = w.paged_copy() if form == "paged" else w.contiguous_copy()
        table = w.cache.page_table if form == "paged" else None
        try:
            err = relative_error(call(q, ks[0], vs[0], None, None, w.start, table), ref)
        except Exception as e:  # noqa: BLE001 (a form this version refuses: the next one)
            print(f"  ({NAMES[which]} {form}: {first_line(e)})")
            continue
        if err < 1e-2:
            op = kvcache_op(torch, which, call)

            def attention(lengths, ks=ks, vs=vs, table=table):
                def attend(i, q, k, v):
                    return op(q, ks[i], vs[i], k, v, lengths, table)
                return attend
            return f"flash_attn_with_kvcache, k=/v= append, {form}", attention
        print(f"  ({NAMES[which]} {form} differs from mhadsl's kernel: relative error "
              f"{err:.3g})")
    return None


PEERS = {"sdpa": sdpa_peer, "fa4": fa4_peer,
         "fa3": lambda torch, w: kvcache_peer(torch, w, "fa3"),
         "fa2": lambda torch, w: kvcache_peer(torch, w, "fa2")}


# ----------------------------------------------------------------------------- the run


def checked_column(torch, w: Workload, key: str, how: str, attention):
    """The column's step, compiled (reduce-overhead, else eager where that fails), its
    first generation run and checked: (column, tokens), or None where it fails."""
    for mode in ("reduce-overhead", "eager"):
        lengths = w.own_lengths()
        col = Column(NAMES[key], compiled_step(torch, w.model, lengths, attention, mode, key),
                     lengths, how, "eager (not compiled)" if mode == "eager" else "")
        try:
            tokens = first_generation(torch, w, col)
        except Exception as e:  # noqa: BLE001 (what torch.compile cannot capture runs eagerly)
            print(f"  ({col.name}, {mode}: {first_line(e)})")
            continue
        wrong = w.check(tokens)
        if wrong:
            print(f"  ({col.name}: {wrong} tokens differ from torch's attention over the "
                  f"whole text; not timed)")
            return None
        return col, tokens
    return None


def agreement(torch, tokens, ours) -> tuple[int, float]:
    """(steps for which every sequence's token equals mhadsl's, share of equal tokens)."""
    same = torch.stack(tokens, 1) == torch.stack(ours, 1)
    every = same.all(0)
    lead = len(ours) if bool(every.all()) else int(every.int().argmin())
    return lead, float(same.float().mean())


def run_workload(torch, ex, model, name: str, steps: int, rounds: int, peers: list[str]):
    from mhadsl.host.bench import time_side_by_side
    batch, shortest, longest = WORKLOADS[name]
    lengths = prompt_lengths(batch, shortest, longest)
    w = Workload(torch, ex, model, lengths, steps)
    shape = (f"B{batch}, {ex.HEADS}:{ex.KV_HEADS} D{ex.HEAD_DIM}, {len(model.layers)} layers, "
             f"prompts {min(lengths)}…{max(lengths)} (mean {sum(lengths) // batch}), "
             f"{steps} steps")
    print(f"\n{name}: {shape}\n  prompt lengths: {' '.join(map(str, lengths))}", flush=True)
    ours = Column("mhadsl", w.mhadsl_step, w.cache.lengths,
                  "decode operator, rows appended by the call, paged 64")
    mine = first_generation(torch, w, ours)
    wrong = w.check(mine)
    if wrong:
        print(f"  mhadsl: {wrong} tokens differ from torch's attention over the whole text")
        raise SystemExit(1)
    columns, tokens = [ours], {"mhadsl": mine}
    for key in peers:
        try:
            found = PEERS[key](torch, w)
        except Exception as e:  # noqa: BLE001 (a peer that cannot be set up: no column)
            print(f"  ({NAMES[key]}: {first_line(e)})")
            found = None
        if found is None:
            print(f"  ({NAMES[key]}: no column)")
            continue
        got = checked_column(torch, w, key, *found)
        if got:
            columns.append(got[0])
            tokens[got[0].name] = got[1]
    fns = {c.name: (lambda c=c: w.generation(c)) for c in columns}
    times = time_side_by_side(torch, fns, rounds=rounds, warmup=1, reps=2)
    rate = {n: batch * steps / (t.ms * 1e-3) for n, t in times.items()}
    same = {c.name: agreement(torch, tokens[c.name], mine) for c in columns}
    print("| column | tokens/s | ms per step | mhadsl ÷ column | same tokens as mhadsl "
          "(steps all equal; share) | what runs |")
    print("|---|---|---|---|---|---|")
    for c in columns:
        lead, share = same[c.name]
        print(f"| {c.name} | {rate[c.name]:.0f} | {times[c.name].ms / steps:.3f} | "
              f"{rate['mhadsl'] / rate[c.name]:.3f}× | {lead} of {steps}; {share:.1%} | "
              f"{c.how}{'; ' + c.mode if c.mode else ''} |", flush=True)
    return {"workload": f"decode steps, {len(model.layers)}-layer model", "shape": shape,
            "rate": rate, "ms": {n: t.ms / steps for n, t in times.items()}, "same": same,
            "modes": {c.name: c.mode for c in columns if c.mode}, "steps": steps}


def software(torch) -> str:
    from importlib.metadata import PackageNotFoundError, version
    parts = [f"torch {torch.__version__}"]
    for label, dists in (("FlashAttention-4", ("flash-attn-4", "fa4")),
                         ("FlashAttention-3", ("flash-attn-3", "flash_attn_3")),
                         ("FlashAttention-2", ("flash-attn", "flash_attn"))):
        for dist in dists:
            try:
                parts.append(f"{label} {version(dist)}")
                break
            except PackageNotFoundError:
                continue
    return ", ".join(parts)


def json_rows(torch, results: list[dict], command: str) -> list[dict]:
    """The workloads' rows in `benchmarks/results.json`'s row format (kind `KIND["id"]`)."""
    from mhadsl.host.bench import source_commit
    commit = source_commit()
    rows = []
    for r in results:
        detail = ("ms per step: " + ", ".join(f"{n} {ms:.3f}" for n, ms in r["ms"].items())
                  + "; tokens equal to mhadsl's: " + ", ".join(
                      f"{n} all for {lead} of {r['steps']} steps, {share:.1%}"
                      for n, (lead, share) in r["same"].items() if n != "mhadsl")
                  + "".join(f"; {n} {mode}" for n, mode in r["modes"].items()))
        rows.append({"kind": KIND["id"], "workload": r["workload"], "shape": r["shape"],
                     "ours": round(r["rate"]["mhadsl"]),
                     "peers": {n: round(x) for n, x in r["rate"].items() if n != "mhadsl"},
                     "detail": detail, "notes": NOTES,
                     "date": str(datetime.date.today()), "gpu": torch.cuda.get_device_name(),
                     "software": software(torch), "commit": commit, "command": command})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all",
                        help="long: B16, prompts 512-4096; short: B32, prompts 128-1024; "
                        "all: both (default)")
    parser.add_argument("--layers", type=int, default=LAYERS,
                        help=f"decoder layers (default {LAYERS})")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help=f"decode steps timed per generation (default {STEPS})")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timing rounds, every column in turn (default 5)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated peers to try (default {','.join(PEERS)})")
    parser.add_argument("--json", metavar="FILE",
                        help="write the rows in benchmarks/results.json's row format")
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        parser.error(f"--peers: no peer {', '.join(unknown)} (known: {', '.join(PEERS)})")
    if args.layers < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--layers, --steps and --rounds must be at least 1")

    from mhadsl.host.bench import require_gpu
    torch = require_gpu()
    ex = load_example(HIDDEN, HEADS, KV_HEADS)
    with torch.device("cuda"):
        model = ex.Model(args.layers).to(torch.bfloat16)
    print(f"generate, {datetime.date.today()}, {torch.cuda.get_device_name()}, bf16; "
          f"hidden {HIDDEN}, {HEADS}:{KV_HEADS} heads of {ex.HEAD_DIM}, {args.layers} layers, "
          f"vocabulary {ex.VOCAB}; {software(torch)}", flush=True)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    with torch.no_grad():
        results = []
        for n in names:
            results.append(run_workload(torch, ex, model, n, args.steps, args.rounds, peers))
            torch._dynamo.reset()  # (the next workload's steps compile anew)
            torch.cuda.empty_cache()
    if args.json:
        command = " ".join(["python3", "benchmarks/generate.py", *sys.argv[1:]])
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_rows(torch, results, command), f, indent=1, ensure_ascii=False)
        print(f"wrote {args.json} (kind {KIND['id']!r}: add {json.dumps(KIND)} to "
              f"benchmarks/results.json's kinds)")


if __name__ == "__main__":
    main()
