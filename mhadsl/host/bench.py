"""Run and time attention kernels next to torch SDPA's flash and cuDNN backends.

Used by `mhadsl run`, `mhadsl bench` and `benchmarks/attention.py`. Needs a GPU and
PyTorch (for random inputs, CUDA events and the torch baselines).
"""
from __future__ import annotations

import statistics
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mhadsl.front.attention_spec import operand_values
from mhadsl.host.api import Kernel
from mhadsl.analysis.reference import evaluate_rule, ragged_sequence_operands, reference


class NoTorch(RuntimeError):
    """PyTorch, which makes the inputs and times the runs, is not installed."""


def source_commit() -> str:
    """The short hash of the checkout this package runs from, for a measurement's record
    ("" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def require_gpu():
    """The torch module, once a CUDA GPU is known to be there (else `NoGpuError`, the
    runtime's own)."""
    from mhadsl.runtime.driver import require_device
    require_device()
    try:
        import torch
    except ImportError:
        raise NoTorch("`mhadsl run` and `mhadsl bench` use PyTorch for inputs and timing: "
                      'pip install "mhadsl[torch]"') from None
    return torch


@dataclass(frozen=True)
class Problem:
    """One workload: dense when `seqlens` is None, else ragged with those lengths (of the
    queries; the keys' are `seqlens_k`, where given, else the same)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    seqlens: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None

    @property
    def key_lengths(self) -> tuple[int, ...] | None:
        return self.seqlens_k if self.seqlens_k is not None else self.seqlens

    def describe(self) -> str:
        keys = "" if self.seqlens_k is None else f" / {sum(self.seqlens_k)} keys"
        shape = (f"ragged {len(self.seqlens)} seqs, {sum(self.seqlens)} tokens{keys}"
                 if self.seqlens
                 else f"B{self.batch} S{self.seqlen_q}" + (f"/{self.seqlen_k}"
                                                          if self.seqlen_k != self.seqlen_q else ""))
        heads = f"H{self.heads}" + (f":{self.kv_heads}" if self.kv_heads != self.heads else "")
        return f"{shape} {heads} D{self.head_dim}"


def make_inputs(torch, kernel: Kernel, p: Problem, seed: int = 0,
                operands: dict | None = None) -> dict:
    """Random inputs of problem `p` for `kernel(**inputs)` and `reference(kernel, **inputs)`,
    with the values of its operands (`operands` by name, else their defaults)."""
    values = operand_values(kernel.options, operands or {})
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = torch.bfloat16 if kernel.options.dtype == "bf16" else torch.float16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    if p.seqlens is None:
        return {"q": rand(p.batch, p.seqlen_q, p.heads, p.head_dim),
                "k": rand(p.batch, p.seqlen_k, p.kv_heads, p.head_dim),
                "v": rand(p.batch, p.seqlen_k, p.kv_heads, p.head_dim), **values}
    def offsets(lengths):
        return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                            device="cuda")
    cu_q = offsets(p.seqlens)
    cu_k = cu_q if p.seqlens_k is None else offsets(p.seqlens_k)
    rows, keys = sum(p.seqlens), sum(p.key_lengths)
    return {"q": rand(rows, p.heads, p.head_dim), "k": rand(keys, p.kv_heads, p.head_dim),
            "v": rand(keys, p.kv_heads, p.head_dim), "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "max_seqlen_q": max(p.seqlens, default=0),
            "max_seqlen_k": max(p.key_lengths, default=0), **values}


def allowed_pairs(kernel: Kernel, p: Problem, operands: dict | None = None) -> int:
    """(query, key) pairs the mask keeps (for the operands' values `operands`): what the
    FLOP count charges for."""
    lengths = list(zip(p.seqlens, p.key_lengths)) if p.seqlens \
        else [(p.seqlen_q, p.seqlen_k)] * p.batch
    rule = kernel.options.mask
    if rule is None:
        return sum(a * b for a, b in lengths)
    total, first_q, first_k = 0, 0, 0
    for b, (sq, sk) in enumerate(lengths):
        rows, keys = slice(first_q, first_q + sq), slice(first_k, first_k + sk)
        first_q, first_k = first_q + sq, first_k + sk
        ops = ragged_sequence_operands(kernel.options, operands or {}, rows, keys) \
            if p.seqlens else operands
        if sq and sk:
            keep = evaluate_rule(rule, kernel.program.checked, ops, b=b, h=0,
                                 q_idx=np.arange(sq)[:, None], kv_idx=np.arange(sk)[None, :],
                                 seqlen_q=sq, seqlen_k=sk)
            total += int(np.broadcast_to(keep, (sq, sk)).sum())
    return total


def time_ms(torch, fn, warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds of `fn()` over `reps` back-to-back runs, each between two CUDA
    events; the host queues them all before waiting, so launch overhead overlaps the GPU
    work as in a real model (as triton.testing.do_bench does)."""
    return statistics.median(_timed_runs(torch, fn, warmup, reps))


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one function timed by `time_side_by_side`."""

    ms: float  # the median over every run of every round
    round_ms: tuple[float, ...]  # each round's median, in round order


def time_side_by_side(torch, fns: dict, rounds: int = 5, warmup: int = 3,
                      reps: int = 10) -> dict[str, Timing | None]:
    """Each of `fns` (name -> callable, or None: not timed) over `rounds` rounds of `reps`
    runs. Each round times every function in turn, starting from a different one each round,
    so all of them meet the GPU's clock and temperature as they drift over a run (a row timed
    once moves by several percent between runs); odd rounds go through the others in reverse,
    so no function always follows the same one (what ran just before a kernel can move its
    time)."""
    names = [name for name, fn in fns.items() if fn is not None]
    samples = {name: [] for name in names}
    for r in range(rounds):
        step = 1 if r % 2 == 0 else -1
        for i in range(len(names)):
            name = names[(r + step * i) % len(names)]
            samples[name].append(_timed_runs(torch, fns[name], warmup, reps))
    return {name: Timing(statistics.median(x for runs in samples[name] for x in runs),
                         tuple(statistics.median(runs) for runs in samples[name]))
            if name in samples else None for name in fns}


def kernel_times(torch, fn, calls: int = 20) -> dict[str, float]:
    """Where a call's GPU time goes: the median microseconds of each kernel `fn()` launches
    (CUPTI's kernel times, through torch.profiler) over `calls` calls, in launch order, and
    of the idle time before each (`"gap before NAME"`; before a call's first kernel, the
    time since the call before it ended)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu = torch.autograd.DeviceType.CUDA
    kernels = sorted((e for e in prof.events() if e.device_type == gpu),
                     key=lambda e: e.time_range.start)
    samples: dict[str, list[float]] = {}
    for event in kernels:
        samples.setdefault(event.name, []).append(event.time_range.end - event.time_range.start)
    for before, event in zip(kernels, kernels[1:]):
        samples.setdefault(f"gap before {event.name}", []).append(
            event.time_range.start - before.time_range.end)
    return {name: statistics.median(x) for name, x in samples.items()}


def _timed_runs(torch, fn, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def check(torch, kernel: Kernel, p: Problem, seed: int = 0,
          operands: dict | None = None) -> tuple[float, bool]:
    """Relative error ‖out − ref‖ / ‖ref‖ against the float64 reference, and NaN-free."""
    args = make_inputs(torch, kernel, p, seed, operands)
    out = kernel(**args, out=torch.full_like(args["q"], float("nan")))
    ref = reference(kernel, **args)
    got = out.float().cpu().numpy().astype(np.float64)
    denom = np.linalg.norm(ref) or 1.0
    return float(np.linalg.norm(got - ref) / denom), bool(np.isfinite(got).all())


def torch_baselines(torch, kernel: Kernel, p: Problem, args: dict) -> dict[str, float | None]:
    """Milliseconds of torch SDPA's flash and cuDNN backends, where they express the mask."""
    return {name: None if fn is None else time_ms(torch, fn)
            for name, fn in torch_baseline_fns(torch, kernel, p, args).items()}


def torch_baseline_fns(torch, kernel: Kernel, p: Problem, args: dict) -> dict:
    """torch SDPA's flash and cuDNN backends on the same inputs, as callables (None where a
    backend cannot express the mask or take the shape), for `time_side_by_side`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    causal = _is_plain_causal(kernel, {o.name: args[o.name] for o in kernel.options.operands})
    if p.seqlens or kernel.options.score is not None or kernel.options.sink is not None \
            or (kernel.options.mask and not causal) \
            or (causal and p.seqlen_q != p.seqlen_k):  # torch's is_causal is top-left only
        return {"flash": None, "cudnn": None}
    q, k, v = (args[n].transpose(1, 2) for n in ("q", "k", "v"))
    fns = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch explains each backend it cannot use
                return sdpa(q, k, v, is_causal=causal, scale=kernel.options.softmax_scale(),
                            enable_gqa=p.heads != p.kv_heads)
        try:
            run()
            fns[name] = run
        except RuntimeError:
            fns[name] = None  # this backend does not take the shape
    return fns


def _is_plain_causal(kernel: Kernel, operands: dict) -> bool:
    """Is the mask torch's is_causal (kv_idx <= q_idx, with Sq == Sk here) for these
    operand values?"""
    rule = kernel.options.mask
    if rule is None:
        return False
    n = 2048  # wide enough that windows and other bands show
    grid = np.arange(n)
    keep = evaluate_rule(rule, kernel.program.checked, operands, b=0, h=0, q_idx=grid[:, None],
                         kv_idx=grid[None, :], seqlen_q=n, seqlen_k=n)
    return bool(np.array_equal(np.broadcast_to(keep, (n, n)), np.tril(np.ones((n, n), bool))))


@dataclass
class Row:
    kernel: str
    problem: str
    ms: float
    tflops: float
    flash: float | None
    cudnn: float | None


def measure(torch, kernel: Kernel, p: Problem, operands: dict | None = None) -> Row:
    args = make_inputs(torch, kernel, p, operands=operands)
    values = {o.name: args[o.name] for o in kernel.options.operands}
    flops = 4.0 * p.head_dim * p.heads * allowed_pairs(kernel, p, values)
    times = time_side_by_side(torch, {"mhadsl": lambda: kernel(**args),
                                      **torch_baseline_fns(torch, kernel, p, args)})

    def tf(t):
        return None if t is None else flops / (t.ms * 1e-3) / 1e12
    return Row(kernel.name, p.describe(), times["mhadsl"].ms, tf(times["mhadsl"]),
               tf(times["flash"]), tf(times["cudnn"]))


def format_table(rows: list[Row]) -> str:
    head = ("| kernel | shape | ms | mhadsl TFLOP/s | torch flash | cuDNN | vs flash |\n"
            "|---|---|---|---|---|---|---|")

    def f(x):
        return "—" if x is None else f"{x:.0f}"
    lines = [head] + [
        f"| {r.kernel} | {r.problem} | {r.ms:.3f} | {r.tflops:.0f} | {f(r.flash)} | "
        f"{f(r.cudnn)} | {'—' if r.flash is None else f'{r.tflops / r.flash:.2f}x'} |"
        for r in rows]
    return "\n".join(lines)


# BENCHMARKS.md's headline shapes (B, H, S, D, causal): what `mhadsl bench` runs by default.
SUITE_SOURCE = "\n".join(
    f"attention {kind}_d{d} {{ dtype = bf16  head_dim = {d}"
    + ("  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx" if kind == "causal" else "") + " }"
    for d in (64, 128, 256) for kind in ("plain", "causal"))
SUITE = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False),
         (4, 32, 4096, 64, False), (2, 16, 8192, 256, False)]


def run_suite(torch) -> list[Row]:
    import mhadsl
    program = mhadsl.compile(SUITE_SOURCE, name="<bench suite>")
    rows = []
    for b, h, s, d, causal in SUITE:
        kernel = program[f"{'causal' if causal else 'plain'}_d{d}"]
        rows.append(measure(torch, kernel, Problem(b, s, s, h, h, d)))
    return rows
