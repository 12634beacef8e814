"""Benchmark: the host time of a call, side by side with torch SDPA (and FlashAttention-4).

    python3 benchmarks/launch_overhead.py              # host time per eager call (tiny kernel)
    python3 benchmarks/launch_overhead.py stability    # B16 H16 S1024 D128 causal, 8 fresh
                                                       # allocations (run it in 5 processes)
    python3 benchmarks/launch_overhead.py kernel NAME  # host vs kernel time of hopper.py's NAME

Host time: 2,000 calls of a tiny kernel (B1 H16 S128 D128, bf16) queued back to back, then
one synchronize, divided by 2,000; each column in turn, over 3 rounds (the best round is
reported, and every round printed). torch SDPA's backend is chosen once, outside the loop.
"""
import statistics
import sys
import time
import warnings

import mhadsl
from mhadsl.host.bench import Problem, make_inputs, require_gpu, time_ms

sys.path.insert(0, "benchmarks")
from hopper import SOURCE  # noqa: E402

CALLS = 2000


def host_us(torch, fn, calls: int = CALLS) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def sdpa_loop(torch, backend, q, k, v, causal: bool):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def loop(calls: int = CALLS) -> float:
        with sdpa_kernel(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return host_us(torch, lambda: sdpa(q, k, v, is_causal=causal), calls)
    return loop


def sdpa_per_call(torch, backend, q, k, v):
    """SDPA with its backend chosen inside each call (as a caller pays for it)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def call():
        with sdpa_kernel(backend):
            return sdpa(q, k, v)
    return lambda calls=CALLS: host_us(torch, call, calls)


def fa4_fn(q, k, v, causal: bool):
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    return lambda: flash_attn_func(q, k, v, causal=causal)


def host_table(torch) -> None:
    from torch.nn.attention import SDPBackend
    program = mhadsl.compile(SOURCE, name="<launch_overhead>")
    problem = Problem(1, 128, 128, 16, 16, 128)
    kernel = program["plain_d128"]
    args = make_inputs(torch, kernel, problem)
    q, k, v = args["q"], args["k"], args["v"]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    op = kernel.torch_op()
    sm80 = mhadsl.compile(SOURCE, name="<launch_overhead sm80>")["plain_d128"]
    sm80.backend = "sm80"
    columns = {
        "mhadsl eager": lambda calls=CALLS: host_us(torch, lambda: kernel(q, k, v), calls),
        "mhadsl eager (sm80)": lambda calls=CALLS: host_us(torch, lambda: sm80(q, k, v), calls),
        "mhadsl torch op": lambda calls=CALLS: host_us(torch, lambda: op(q, k, v), calls),
        "SDPA cuDNN": sdpa_loop(torch, SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False),
        "SDPA flash": sdpa_loop(torch, SDPBackend.FLASH_ATTENTION, qt, kt, vt, False),
        "SDPA cuDNN, per call": sdpa_per_call(torch, SDPBackend.CUDNN_ATTENTION, qt, kt, vt),
    }
    fa4 = fa4_fn(q, k, v, False)
    if fa4 is not None:
        columns["FlashAttention-4"] = lambda calls=CALLS: host_us(torch, fa4, calls)
    rounds = {name: [] for name in columns}
    for r in range(3):
        names = list(columns)
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            rounds[name].append(columns[name]())
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    out = torch.empty_like(q)
    with torch.cuda.stream(stream):
        kernel(q, k, v, out=out)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            kernel(q, k, v, out=out)
    replay = host_us(torch, graph.replay)
    print(f"host time per call, B1 H16 S128 D128 bf16, {CALLS} calls then one synchronize "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})")
    best_sdpa = min(min(rounds["SDPA cuDNN"]), min(rounds["SDPA flash"]))  # backend set once
    for name, values in rounds.items():
        print(f"  {name:22s} {min(values):7.1f} us  ({min(values) / best_sdpa:.2f}x the better "
              f"SDPA)  rounds: {', '.join(f'{x:.1f}' for x in values)}")
    print(f"  {'mhadsl graph replay':22s} {replay:7.1f} us")
    # the first call of a new signature (the build loaded already): a plan, then the launch
    firsts = []
    for seqlen in (136, 144, 152, 160, 168):
        a = make_inputs(torch, kernel, Problem(1, seqlen, seqlen, 16, 16, 128))
        torch.cuda.synchronize()
        start = time.perf_counter()
        kernel(**a)
        firsts.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    print(f"  first call of a new signature: {', '.join(f'{x:.0f}' for x in firsts)} us "
          f"(a planned call: {min(rounds['mhadsl eager']):.1f})")


def stability(torch) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    kernel = mhadsl.compile(SOURCE, name="<stability>")["causal_d128"]
    problem = Problem(16, 1024, 1024, 16, 16, 128)
    flops = 4 * 16 * 16 * 1024 * 1024 * 128 / 2
    for alloc in range(8):
        args = make_inputs(torch, kernel, problem, seed=alloc)
        q, k, v = (args[n].transpose(1, 2) for n in ("q", "k", "v"))
        ours = time_ms(torch, lambda: kernel(**args), reps=50)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = time_ms(torch, lambda: sdpa(q, k, v, is_causal=True), reps=50)
        print(f"STABILITY alloc {alloc} mhadsl {flops / ours / 1e9:.1f} "
              f"cudnn {flops / cudnn / 1e9:.1f}", flush=True)


def versus_kernel(torch, name: str) -> None:
    """Each design's host time per call against its kernel's own (CUDA-graph replay)."""
    program = mhadsl.compile(SOURCE, name="<launch_overhead>")
    problem = Problem(4, 4096, 4096, 16, 16, 128)
    designs = ("sm80", "sm90") if torch.cuda.get_device_capability() == (9, 0) else ("sm80",)
    for design in designs:
        kernel = program[name]
        kernel.backend = design
        args = make_inputs(torch, kernel, problem)

        def call():
            return kernel(**args)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(stream):
            call()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                call()
        for _ in range(3):
            print(f"{name} {design}: host {host_us(torch, call, 200):.0f} us per call, back to "
                  f"back {time_ms(torch, call) * 1e3:.0f} us, graph replay "
                  f"{time_ms(torch, graph.replay) * 1e3:.0f} us", flush=True)


def summarize(lines: list[str]) -> None:
    """The stability runs' figures (lines of `stability` from several processes)."""
    ours = [float(line.split()[4]) for line in lines if line.startswith("STABILITY")]
    cudnn = [float(line.split()[6]) for line in lines if line.startswith("STABILITY")]
    median = statistics.median(ours)
    spread = max(abs(x / median - 1) for x in ours)
    print(f"mhadsl: {len(ours)} figures, median {median:.1f} TFLOP/s, all within "
          f"{spread * 100:.1f} % of it (min {min(ours):.1f}, max {max(ours):.1f}); cuDNN "
          f"median {statistics.median(cudnn):.1f}: {median / statistics.median(cudnn):.3f}x")


def main() -> None:
    if sys.argv[1:2] == ["summarize"]:
        return summarize(sys.stdin.read().splitlines())
    torch = require_gpu()
    mode = sys.argv[1] if len(sys.argv) > 1 else "host"
    if mode == "host":
        host_table(torch)
    elif mode == "stability":
        stability(torch)
    elif mode == "kernel":
        versus_kernel(torch, sys.argv[2] if len(sys.argv) > 2 else "window")
    else:
        sys.exit(f"unknown mode {mode!r}: host, stability, kernel NAME or summarize")


if __name__ == "__main__":
    main()
