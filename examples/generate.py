"""Token generation with a paged KV cache: the pieces of a serving engine's decode loop.

    python examples/generate.py [--layers 4] [--batch 8] [--steps 64]

A small decoder-only model with random weights (GQA attention, RMSNorm, a SiLU MLP) runs
on one mhadsl kernel, `step` below, in two kinds of calls against the same paged cache:

- the prefill of each prompt (ragged query rows, `cu_seqlens_q`), which writes the prompts'
  keys and values into the cache (`k_new`/`v_new`) and attends over them causally;
- then one row per sequence and step, under `torch.compile(mode="reduce-overhead")`: each
  step appends its token's keys and values and attends over the whole cache, and the
  compiled step replays as a CUDA graph with new lengths every time.

At the end the generated tokens are checked: the model run once over every sequence's whole
text with torch's own attention must predict the same tokens (greedy decoding), and the
tokens per second are printed.
"""
from __future__ import annotations

import argparse
import time

import torch

import mhadsl

STEP = """
attention step { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q
}
"""
HEAD_DIM, HEADS, KV_HEADS, HIDDEN, VOCAB, PAGE = 128, 16, 4, 2048, 4096, 64


class Model(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
        self.norm = torch.nn.RMSNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, attend):
        """Logits of `tokens` (rows, ...), each layer's attention done by `attend(layer, q,
        k, v)`."""
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, lambda q, k, v, i=i: attend(i, q, k, v))
        return self.head(self.norm(x)).float()


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(HIDDEN), torch.nn.RMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.up = torch.nn.Linear(HIDDEN, 2 * 4 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x, attend):
        q, k, v = self.qkv(self.norm1(x)).split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        heads = x.shape[:-1]
        o = attend(q.reshape(*heads, HEADS, HEAD_DIM), k.reshape(*heads, KV_HEADS, HEAD_DIM),
                   v.reshape(*heads, KV_HEADS, HEAD_DIM))
        x = x + self.out(o.reshape(*heads, HEADS * HEAD_DIM))
        gate, up = self.up(self.norm2(x)).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class PagedCache:
    """Each layer's K and V pages, one page table for every layer (a sequence's pages are
    the same in each), and the keys each sequence holds."""

    def __init__(self, layers: int, batch: int, capacity: int):
        pages_each = -(-capacity // PAGE)
        shape = (batch * pages_each, PAGE, KV_HEADS, HEAD_DIM)
        self.k = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        order = torch.randperm(batch * pages_each, device="cuda")  # pages anywhere
        self.page_table = order.reshape(batch, pages_each).to(torch.int32)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device="cuda")
        # the compiled step writes the pages and the lengths: CUDA graphs capture a step that
        # writes its inputs only where their addresses are static
        for t in (*self.k, *self.v, self.page_table, self.lengths):
            torch._dynamo.mark_static_address(t)


def prefill(model: Model, prompts: list[torch.Tensor], capacity: int):
    """Every prompt attended and written into a new paged cache of `capacity` keys a
    sequence: (the cache, each sequence's first generated token, the decode step compiled
    with `mode="reduce-overhead"`: tokens (batch,) -> the next ones, appending to the cache)."""
    kern = mhadsl.compile(STEP)["step"]
    op = kern.torch_decode_op()
    cache = PagedCache(len(model.layers), len(prompts), capacity)
    lengths = [len(p) for p in prompts]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")

    def attend_prompts(i, q, k, v):  # ragged rows: the prompts, appended and attended causally
        out, _ = op(q, cache.k[i], cache.v[i], cache.lengths, page_table=cache.page_table,
                    cu_seqlens_q=cu, max_seqlen_q=max(lengths), k_new=k, v_new=v)
        return out

    with torch.no_grad():
        logits = model(torch.cat(prompts), attend_prompts)
        cache.lengths += torch.tensor(lengths, dtype=torch.int32, device="cuda")
        last = cu[1:].long() - 1
        token = logits[last].argmax(-1)

    def decode(i, q, k, v):  # one row per sequence: (batch, 1, heads, head dim)
        out, _ = op(q, cache.k[i], cache.v[i], cache.lengths, page_table=cache.page_table,
                    k_new=k, v_new=v)
        return out

    def one_step(token):
        logits = model(token[:, None], decode)[:, 0]
        cache.lengths += 1
        return logits.argmax(-1)

    return cache, token, torch.compile(one_step, mode="reduce-overhead", fullgraph=True)


def decode_loop(step, token: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The `steps` tokens that `step` (tokens -> next tokens) generates after `token`, each
    copied out of the step's CUDA graph (whose next replay overwrites its output)."""
    tokens = []
    for _ in range(steps):
        token = step(token.clone()).clone()
        tokens.append(token)
    return tokens


def generate(model: Model, prompts: list[torch.Tensor], steps: int) -> tuple[list, float]:
    """Greedy decoding of `steps` tokens after each prompt: (each sequence's tokens, tokens
    per second of the decode steps)."""
    batch = len(prompts)
    cache, token, compiled = prefill(model, prompts, max(map(len, prompts)) + steps)
    with torch.no_grad():
        compiled(token.clone())  # (compiling and capturing: not timed; its step is undone)
        cache.lengths -= 1
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = [token, *decode_loop(compiled, token, steps - 1)]
        torch.cuda.synchronize()
        rate = batch * (steps - 1) / (time.perf_counter() - start)
    generated = torch.stack(tokens, 1)
    return [torch.cat([p, g]) for p, g in zip(prompts, generated)], rate


def check(model: Model, texts: list[torch.Tensor], steps: int) -> int:
    """How many generated tokens the model run over each whole text with torch's attention
    predicts otherwise (greedy: each must be the argmax after the text before it)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def attend(_, q, k, v):  # one sequence: (rows, heads, head dim), causal
        rep = HEADS // KV_HEADS
        q, k, v = (x.transpose(0, 1) for x in (q, k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1)))
        return sdpa(q, k, v, is_causal=True).transpose(0, 1)
    wrong = 0
    with torch.no_grad():
        for text in texts:
            logits = model(text[:-1], attend)[-steps:]
            predicted = logits.argmax(-1)
            top2 = logits.topk(2, -1).values
            close = (top2[:, 0] - top2[:, 1]) < 0.05 * top2[:, 0].abs().clamp(min=1)
            wrong += int(((predicted != text[-steps:]) & ~close).sum())
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    model = Model(args.layers).cuda().to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    prompts = [torch.randint(VOCAB, (int(n),), generator=g, device="cuda")
               for n in torch.randint(1, 600, (args.batch,), generator=g, device="cuda")]
    texts, rate = generate(model, prompts, args.steps)
    wrong = check(model, texts, args.steps)
    print(f"{args.batch} sequences x {args.steps} tokens, {args.layers} layers: "
          f"{rate:.0f} tokens/s; {wrong} tokens differ from torch's attention")
    if wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
