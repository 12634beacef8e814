"""The backward pass on the GPU against the float64 reference (`mhadsl.reference_backward`):
dQ, dK and dV of fresh random inputs within 1e-2 relative error (Frobenius norm) for dense
and ragged batches with lengths 0, 1, 127, 129 and 3000, Sq != Sk, the mask and score
examples (causal, bottom-right causal, a window, ALiBi, softcap), GQA and MQA (on Hopper a
group of 6 split over CTAs too), head dims 64/128/256, bf16 and fp16; through the torch
operator's autograd (`out.backward()`); the main kernel driven by each standard scheduler
and a user's; and deterministic mode bitwise repeatable over 20 runs."""
import numpy as np
import pytest

import mhadsl
from helpers import REPO

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

RAGGED = [0, 1, 127, 129, 3000]


def kernel(file: str, name: str):
    return mhadsl.compile(REPO / "examples" / file)[name]


def backward_builds(kern) -> list:
    """The backward builds the kernel's calls loaded (`mhadsl.host.launcher.Loaded`)."""
    return [loaded for loaded in kern.launcher.loaded.values() if loaded.layout.backward]


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _dtype(kern):
    return torch.bfloat16 if kern.options.dtype == "bf16" else torch.float16


def dense(kern, b, sq, sk, hq, hkv):
    d, dt = kern.options.head_dim, _dtype(kern)
    return dict(q=rand(b, sq, hq, d, dtype=dt), k=rand(b, sk, hkv, d, dtype=dt),
                v=rand(b, sk, hkv, d, dtype=dt))


def ragged(kern, lens_q, lens_k, hq, hkv):
    d, dt = kern.options.head_dim, _dtype(kern)
    offsets = [torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32,
                            device="cuda") for n in (lens_q, lens_k)]
    return dict(q=rand(sum(lens_q), hq, d, dtype=dt), k=rand(sum(lens_k), hkv, d, dtype=dt),
                v=rand(sum(lens_k), hkv, d, dtype=dt), cu_seqlens_q=offsets[0],
                cu_seqlens_k=offsets[1])


def assert_close(name, got, want, dout, tolerance=1e-2):
    """Relative error below `tolerance`; where the exact gradient vanishes (one key: P = 1,
    so dS = 0 and dQ = dK = 0), relative to a hundredth of dO's norm instead."""
    got = got.float().cpu().numpy().astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: NaN or inf"
    floor = 1e-2 * np.linalg.norm(dout.float().cpu().numpy())
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), floor)
    assert err < tolerance, (name, err, got.shape)


def assert_gradients(kern, args, deterministic=False, runs=1):
    """The gradients against the reference; with `runs` > 1, every run's bitwise the same."""
    offsets = {n: args[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in args}
    out, lse = kern(**args, return_lse=True)
    dout = torch.randn_like(out)
    grads = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, **offsets,
                          deterministic=deterministic)
    for _ in range(runs - 1):
        again = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, **offsets,
                              deterministic=deterministic)
        for name, first, later in zip(("dq", "dk", "dv"), grads, again):
            assert torch.equal(first, later), f"{name} differs between runs"
    ref = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout, **offsets)
    for name, got, want, like in zip(("dq", "dk", "dv"), grads, ref, "qkv"):
        assert got.shape == args[like].shape and got.dtype == args[like].dtype
        assert_close(name, got, want, dout)
    return grads


@pytest.mark.parametrize("file, name", [
    ("plain.mha", "plain_fwd"), ("plain.mha", "plain_fp16_d64"), ("causal.mha", "causal_fwd"),
    ("sliding_window.mha", "sliding_window_256"), ("softcap.mha", "softcap_causal"),
    ("alibi.mha", "alibi_causal"),
])
def test_examples_against_reference(file, name):
    kern = kernel(file, name)
    for shape in ((1, 1, 1, 2, 2), (1, 127, 127, 2, 2), (2, 129, 129, 2, 2),
                  (1, 3000, 3000, 1, 1)):
        assert_gradients(kern, dense(kern, *shape))
    assert_gradients(kern, ragged(kern, RAGGED, RAGGED, 2, 2))


def test_bottom_right_causal_with_unequal_lengths():
    kern = kernel("bottom_right_causal.mha", "bottom_right_causal")
    assert_gradients(kern, dense(kern, 2, 100, 300, 2, 2))
    assert_gradients(kern, dense(kern, 1, 700, 260, 2, 2))
    assert_gradients(kern, ragged(kern, [5, 0, 127, 64], [300, 7, 129, 64], 2, 2))


@pytest.mark.parametrize("name, hq, hkv", [("gqa_causal", 8, 2), ("mqa", 4, 1)])
def test_gqa_and_mqa_sum_dk_dv_over_the_group(name, hq, hkv):
    kern = kernel("gqa.mha", name)
    assert_gradients(kern, dense(kern, 2, 200, 200, hq, hkv))
    assert_gradients(kern, ragged(kern, [129, 0, 300], [129, 64, 300], hq, hkv))


VARS = """attention var_score { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) { var x = s
        if q_idx > kv_idx + 16 { x *= 0.5 }
        var y = 0.0
        y += 30.0 * tanh(x / 30.0)
        return y } }
"""


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_a_score_that_assigns_vars_has_its_gradients(deterministic):
    """The score's derivative follows its `var`s through branches and compound assignments
    (`mhadsl.analysis.derivative`), dense and ragged."""
    kern = mhadsl.compile(VARS, name="<vars>")["var_score"]
    assert_gradients(kern, dense(kern, 2, 200, 200, 2, 2), deterministic=deterministic)
    assert_gradients(kern, ragged(kern, RAGGED, RAGGED, 2, 2), deterministic=deterministic)


WIDE = """import "std/schedulers.mha"
attention causal_d256 { dtype = bf16  head_dim = 256  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_d256 { dtype = bf16  head_dim = 256 }
attention softcap_fp16_d256 { dtype = fp16  head_dim = 256
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0) }
"""


@pytest.mark.parametrize("design", ["backward", "backward_sm90"])
@pytest.mark.parametrize("name", ["causal_d256", "plain_d256", "softcap_fp16_d256"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_head_dim_256(name, deterministic, design):
    """The sm80-style design computes dK and dV in two column passes over the query tiles
    (each recomputing S^T and dP^T); the Hopper design's two consumer warpgroups share
    K/V tiles of 64 rows, each owning half of dK's and dV's columns and computing S^T and
    dP^T for half of each step's query rows (300 rows: a last tile whose second half is
    partly past the sequence). GQA, dense and ragged (lengths 0 and 1 among them)."""
    from mhadsl.codegen.backends.backward_sm90 import HopperBackwardConfig
    if design == "backward_sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper design runs on compute capability 9.0")
    kern = mhadsl.compile(WIDE, name="<d256>")[name]
    kern.backend = design
    assert_gradients(kern, dense(kern, 2, 300, 300, 4, 2), deterministic=deterministic)
    assert_gradients(kern, ragged(kern, RAGGED, RAGGED, 2, 1), deterministic=deterministic)
    configs = [loaded.config for loaded in backward_builds(kern)]
    assert len(configs) == 2
    if design == "backward":
        assert all(c.column_passes == 2 for c in configs)
    else:
        assert all(isinstance(c, HopperBackwardConfig) and c.block_n == 64
                   and c.score_columns == 32 for c in configs)


HOPPER_RAGGED = """import "std/schedulers.mha"
attention causal_gqa_d64 { dtype = fp16  head_dim = 64  gqa = 4
                           mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention causal_gqa_d256 { dtype = bf16  head_dim = 256  gqa = 2
                            mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""


@pytest.mark.parametrize("source, name, hq, hkv", [
    ("plain.mha", "plain_fwd", 2, 2), ("causal.mha", "causal_fwd", 2, 2),
    ("gqa.mha", "gqa_causal", 8, 2), (HOPPER_RAGGED, "causal_gqa_d64", 8, 2),
    (HOPPER_RAGGED, "causal_gqa_d256", 4, 2)],
    ids=["plain_fwd", "causal_fwd", "gqa_causal", "causal_gqa_d64", "causal_gqa_d256"])
def test_ragged_calls_run_the_hopper_design(source, name, hq, hkv):
    """On compute capability 9.0 a ragged atomic call runs backward_sm90, whose tiles read
    past a sequence's end into the next sequence's rows (and past the last into the
    tensor's spare rows): lengths 0, 1, 127, 129 and 3000; then spare rows before the first
    sequence and after the last (finite), whose gradients stay zero."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper design runs on compute capability 9.0")
    from mhadsl.codegen.backends.backward_sm90 import HopperBackwardConfig
    kern = kernel(source, name) if source.endswith(".mha") else \
        mhadsl.compile(source, name="<hopper-ragged>")[name]
    assert_gradients(kern, ragged(kern, RAGGED, RAGGED, hq, hkv))
    lens_q, lens_k, before, after = [129, 1, 0, 200], [64, 1, 300, 127], 3, 70
    args = ragged(kern, lens_q, lens_k, hq, hkv)
    for name_ in ("q", "k", "v"):  # spare rows around the sequences' rows
        t = args[name_]
        args[name_] = torch.cat([rand(before, *t.shape[1:], dtype=t.dtype), t,
                                 rand(after, *t.shape[1:], dtype=t.dtype)])
    for name_ in ("cu_seqlens_q", "cu_seqlens_k"):
        args[name_] = args[name_] + before
    grads = assert_gradients(kern, args)
    for grad, lens in zip(grads, (lens_q, lens_k, lens_k)):
        assert not grad[:before].float().any() and not grad[before + sum(lens):].float().any()
    for loaded in backward_builds(kern):
        assert loaded.layout.ragged and isinstance(loaded.config, HopperBackwardConfig) \
            and loaded.config.ragged


SPLIT_GROUP = """import "std/schedulers.mha"
attention causal_gqa6 { dtype = bf16  head_dim = 128  gqa = 6
                        mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_gqa6 { dtype = bf16  head_dim = 128  gqa = 6 }
attention causal_gqa6_d64 { dtype = fp16  head_dim = 64  gqa = 6
                            mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""


def split_group_kernel(name: str):
    """A declaration of 6 query heads per K/V head, whose calls on compute capability 9.0
    split the group over CTAs (`backward_sm90.SPLIT_GROUP_MIN`, and
    `DETERMINISTIC_SPLIT_GROUP_MIN`: their default scheduler, Queued, keeps the order)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper design runs on compute capability 9.0")
    return mhadsl.compile(SPLIT_GROUP, name="<split-group>")[name]


def assert_split_builds(kern, deterministic):
    """Every backward build the kernel's calls loaded is the Hopper design's split one, in
    the mode asked for."""
    from mhadsl.codegen.backends.backward_sm90 import HopperBackwardConfig
    builds = backward_builds(kern)
    assert builds and all(isinstance(loaded.config, HopperBackwardConfig)
                          and loaded.config.split_group
                          and loaded.config.deterministic == deterministic
                          for loaded in builds)


# deterministic calls run 5 times, bitwise the same: dK and dV added in the group's order
SPLIT_MODES = pytest.mark.parametrize("deterministic", [False, True],
                                      ids=["atomic", "deterministic"])


def split_runs(deterministic: bool) -> dict:
    return dict(deterministic=deterministic, runs=5 if deterministic else 1)


@SPLIT_MODES
@pytest.mark.parametrize("name", ["causal_gqa6", "causal_gqa6_d64"])
def test_a_split_group_sums_dk_dv_over_its_query_heads_ctas(name, deterministic):
    """Dense causal calls of 12 query heads on 2 K/V heads: each CTA works on one query
    head's share of a K/V tile and adds its dK and dV into fp32 accumulators, which the
    last kernel turns into dK (times the scale) and dV."""
    kern = split_group_kernel(name)
    assert_gradients(kern, dense(kern, 2, 1000, 1000, 12, 2), **split_runs(deterministic))
    assert_gradients(kern, dense(kern, 1, 129, 129, 6, 1), **split_runs(deterministic))
    assert_split_builds(kern, deterministic)


@SPLIT_MODES
def test_a_split_group_without_a_mask_and_with_more_keys_than_queries(deterministic):
    """No mask, 20 times more keys than queries: the preprocess zeroes the accumulators'
    K/V rows in strides over its few query-row CTAs."""
    kern = split_group_kernel("plain_gqa6")
    assert_gradients(kern, dense(kern, 2, 100, 2000, 12, 2), **split_runs(deterministic))
    assert_gradients(kern, dense(kern, 1, 300, 300, 12, 2), **split_runs(deterministic))
    assert_split_builds(kern, deterministic)


@SPLIT_MODES
@pytest.mark.parametrize("name", ["causal_gqa6", "causal_gqa6_d64"])
def test_a_split_group_runs_ragged_calls(name, deterministic):
    """Ragged: lengths 0, 1, 127, 129 and 3000, then spare rows (finite) before the first
    sequence and after the last, whose gradients stay zero: no accumulator row outside a
    sequence is converted."""
    kern = split_group_kernel(name)
    assert_gradients(kern, ragged(kern, RAGGED, RAGGED, 6, 1), **split_runs(deterministic))
    lens_q, lens_k, before, after = [129, 1, 0, 200], [64, 1, 300, 127], 3, 70
    args = ragged(kern, lens_q, lens_k, 12, 2)
    for tensor in ("q", "k", "v"):
        t = args[tensor]
        args[tensor] = torch.cat([rand(before, *t.shape[1:], dtype=t.dtype), t,
                                  rand(after, *t.shape[1:], dtype=t.dtype)])
    for offsets in ("cu_seqlens_q", "cu_seqlens_k"):
        args[offsets] = args[offsets] + before
    grads = assert_gradients(kern, args, **split_runs(deterministic))
    for grad, lens in zip(grads, (lens_q, lens_k, lens_k)):
        assert not grad[:before].float().any() and not grad[before + sum(lens):].float().any()
    assert_split_builds(kern, deterministic)
    assert all(loaded.layout.ragged for loaded in backward_builds(kern))


@pytest.mark.parametrize("deterministic", [False, True])
def test_rows_outside_every_sequence_get_zero_gradients(deterministic):
    """The gradients are allocated empty: the preprocess zeroes dQ's, dK's and dV's rows
    before the first sequence and after the last, which no other kernel writes. The
    allocator is handed NaN-filled blocks of the gradients' sizes just before, so a row left
    unwritten shows. causal_fwd's scheduler is LPT: its deterministic calls run the
    sm80-style design, its atomic ones on compute capability 9.0 the Hopper design."""
    kern = kernel("causal.mha", "causal_fwd")
    lens_q, lens_k, before, after = [129, 1, 0, 200], [64, 1, 300, 127], 3, 70
    args = ragged(kern, lens_q, lens_k, 2, 2)
    for name in ("q", "k", "v"):
        t = args[name]
        args[name] = torch.cat([rand(before, *t.shape[1:]), t, rand(after, *t.shape[1:])])
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        args[name] = args[name] + before
    out, lse = kern(**args, return_lse=True)
    dout = torch.randn_like(out)
    offsets = {n: args[n] for n in ("cu_seqlens_q", "cu_seqlens_k")}
    stale = [torch.full_like(args[n], float("nan")) for n in ("q", "k", "v")]
    del stale
    grads = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, **offsets,
                          deterministic=deterministic)
    for grad, lens in zip(grads, (lens_q, lens_k, lens_k)):
        inside = grad[before:before + sum(lens)].float()
        assert not grad[:before].float().any() and not grad[before + sum(lens):].float().any()
        assert torch.isfinite(inside).all()


def test_a_signature_is_planned_once():
    kern = kernel("causal.mha", "causal_fwd")
    for _ in range(2):
        assert_gradients(kern, dense(kern, 1, 130, 130, 2, 2))
    assert sum(key[0] == "backward" for key in kern.launcher.plans) == 1


def test_torch_op_backward():
    kern = kernel("causal.mha", "causal_fwd")
    op = kern.torch_op()
    args = dense(kern, 2, 257, 257, 2, 2)
    q, k, v = (args[n].clone().requires_grad_() for n in "qkv")
    out, _lse = op(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = mhadsl.reference_backward(kern, q, k, v, dout)
    for name, t, want in zip(("dq", "dk", "dv"), (q, k, v), ref):
        assert_close(name, t.grad, want, dout)


def test_torch_op_backward_ragged():
    kern = kernel("sliding_window.mha", "sliding_window_256")
    op = kern.torch_op()
    args = ragged(kern, [300, 1, 129], [300, 1, 129], 2, 2)
    q, k, v = (args[n].clone().requires_grad_() for n in "qkv")
    out, _lse = op(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], 300, 300)
    out.float().square().sum().backward()
    dout = 2 * out.detach().float()
    ref = mhadsl.reference_backward(kern, q, k, v, dout, cu_seqlens_q=args["cu_seqlens_q"],
                                    cu_seqlens_k=args["cu_seqlens_k"])
    for name, t, want in zip(("dq", "dk", "dv"), (q, k, v), ref):
        assert_close(name, t.grad, want, dout)


def test_torch_compile_forward_and_backward():
    kern = kernel("causal.mha", "causal_fwd")
    op = kern.torch_op()
    args = dense(kern, 1, 200, 200, 2, 2)

    def loss(q, k, v):
        return op(q, k, v)[0].float().square().sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        q, k, v = (args[n].clone().requires_grad_() for n in "qkv")
        fn(q, k, v).backward()
        grads.append([t.grad.float() for t in (q, k, v)])
    for eager, compiled in zip(*grads):
        assert torch.allclose(eager, compiled, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("variant", [
    dict(dq_passes=2, park_work_tile=False), dict(step_passes=2),
    dict(block_m=32, opaque_env=False), dict(block_m=32, dq_passes=2),
    dict(block_n=128, num_warps=8)],
    ids=["dq-passes-2-held", "step-passes-2", "block-m-32-env-held", "block-m-32-dq-passes-2",
         "8-warps"])
def test_every_fallback_build_is_correct(variant, monkeypatch, tmp_path):
    """The builds and IR shapes `Backward.configs` falls back to when ptxas spills, each
    forced, atomic and deterministic."""
    from dataclasses import replace

    from mhadsl.codegen.backends import spill_free_build
    from mhadsl.codegen.backends.backward import BACKEND, build_backward_module
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))  # forced builds stay out of the cache

    def forced(source, configs, target):
        config = replace(configs[0], **variant)
        return spill_free_build(BACKEND.name, target, [
            (config, lambda: build_backward_module(
                config, source.hooks, target, source.work_loop(*BACKEND.scheduler_shape(config))))])
    monkeypatch.setattr(BACKEND, "build", forced)
    for file, name, hq, hkv, dense_deterministic in (("gqa.mha", "gqa_causal", 8, 2, False),
                                                     ("softcap.mha", "softcap_causal", 2, 2,
                                                      True)):
        kern = kernel(file, name)
        kern.backend = "backward"  # (on sm_90a a dense atomic call runs backward_sm90)
        assert_gradients(kern, dense(kern, 2, 200, 200, hq, hkv), dense_deterministic)
        assert_gradients(kern, ragged(kern, [129, 0, 300], [129, 64, 300], hq, hkv),
                         not dense_deterministic)
        configs = {loaded.config for loaded in backward_builds(kern)}
        assert len(configs) == 2 and all(replace(c, **variant) == c for c in configs)


@pytest.mark.parametrize("file, name, hq, hkv", [
    ("gqa.mha", "gqa_causal", 8, 2), ("causal.mha", "causal_fwd", 2, 2),
    ("plain.mha", "plain_fwd", 4, 4), ("softcap.mha", "softcap_causal", 2, 2),
    ("bottom_right_causal.mha", "bottom_right_causal", 2, 2)])
def test_deterministic_mode_is_bitwise_repeatable_and_correct(file, name, hq, hkv):
    """20 runs bitwise the same (dQ without atomics; dK, dV summed over the GQA group in
    one order), against the float64 reference; dense (2 x 1000 rows: 16 K/V tiles add
    into every dQ row) and ragged."""
    kern = kernel(file, name)
    assert_gradients(kern, dense(kern, 2, 1000, 1000, hq, hkv), deterministic=True, runs=20)
    assert_gradients(kern, ragged(kern, [700, 0, 1, 129], [900, 64, 1, 129], hq, hkv),
                     deterministic=True, runs=20)


def test_deterministic_through_autograd_follows_torch():
    """`torch.use_deterministic_algorithms(True)` (and the operator's `deterministic=True`)
    run the deterministic kernels: bitwise repeatable gradients through `out.backward()`."""
    kern = kernel("gqa.mha", "gqa_causal")
    op = kern.torch_op()
    args = dense(kern, 2, 513, 513, 8, 2)
    dout = torch.randn(2, 513, 8, kern.options.head_dim, device="cuda", dtype=torch.bfloat16)

    def grads(**options):
        q, k, v = (args[n].clone().requires_grad_() for n in "qkv")
        op(q, k, v, **options)[0].backward(dout)
        return [t.grad for t in (q, k, v)]

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = grads()
        for _ in range(4):
            assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert all(torch.equal(a, b) for a, b in zip(first, grads(deterministic=True)))
    assert {loaded.layout.deterministic for loaded in backward_builds(kern)} == {True}
    ref = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout)
    for name, got, want in zip(("dq", "dk", "dv"), first, ref):
        assert_close(name, got, want, dout)


SCHEDULED = """
import "queued_rotate.mha"
attention lpt { dtype = bf16  head_dim = 128  gqa = 4  scheduler = LPT(num_ctas = 3)
                mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention queued { dtype = bf16  head_dim = 128  gqa = 4
                   scheduler = Queued(order = LONGEST_FIRST, heads_per_section = 1)
                   mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention persistent { dtype = fp16  head_dim = 64  gqa = 4  scheduler = Persistent(num_ctas = 7)
                       mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx + seqlen_k - seqlen_q }
attention transient { dtype = bf16  head_dim = 128  gqa = 4  scheduler = Transient() }
attention users { dtype = bf16  head_dim = 64  gqa = 4  scheduler = MyQueued(num_ctas = 5)
                  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""


@pytest.mark.parametrize("name", ["lpt", "queued", "persistent", "transient", "users"])
def test_the_scheduler_drives_the_backward(name):
    """The main kernel's K/V tiles come from the declaration's scheduler (few CTAs: many
    tiles each, in the scheduler's order; `users`: examples/queued_rotate.mha's, which
    skips tiles past a sequence's end in a `while`), dense and ragged, GQA 4:1, Sq != Sk."""
    kern = mhadsl.compile(SCHEDULED, name="scheduled", include_dirs=[REPO / "examples"])[name]
    assert_gradients(kern, dense(kern, 2, 300, 450, 8, 2))
    assert_gradients(kern, ragged(kern, [129, 0, 300, 64], [200, 64, 300, 1], 8, 2))
