"""Attention declarations, the Python API's argument checks and builds (no GPU needed)."""
import numpy as np
import pytest

import mhadsl
from mhadsl.host import forward
from helpers import EXAMPLES, REPO

ATTENTION_EXAMPLES = [p for p in EXAMPLES if "attention " in p.read_text()]


def kernels_of(path):
    program = mhadsl.compile(path)
    return [program[name] for name in program.attentions]


def test_examples_cover_the_promised_variants():
    names = {k.name for p in ATTENTION_EXAMPLES for k in kernels_of(p)}
    assert {"plain_fwd", "causal_fwd", "bottom_right_causal", "sliding_window_256",
            "softcap_causal", "alibi_causal", "gqa_causal", "mqa"} <= names


# sm80 builds whose primary tile spills at every IR shape, so they settle on the narrow
# fallback tile. Any other build that falls back is a regression: a slower kernel and a build
# that tries all the shapes twice. On sm_90a these are ragged builds of the sm80 design, which
# a 9.0 device runs only when forced (its default there is sm90): the valid-tile index's
# lookups (binary search over cu_seqlens' tile prefix sums) under LPT moved two of them onto
# the fallback and softcap_causal off it (the dense sliding window too); the work loop's
# zeroed SeqInfo after the last advance (fewer registers live) moved the sliding window's,
# and K's rows taken from Q's where a call passes one offsets tensor moved it back;
# softcap_causal's returned with its division by a constant taken as a multiplication.
NARROW_TILE_BUILDS = {(name, "sm_90a", True)
                      for name in ("causal_fwd", "gqa_causal", "softcap_causal")}
# A mask or score that reads a tensor at every element (a relative-position bias table, a
# document id per position) holds its loads' registers: the narrow KV tile too.
NARROW_TILE_BUILDS |= {(name, arch, ragged) for name in ("relative_bias", "document_mask")
                       for arch in ("sm_80", "sm_90a") for ragged in (False, True)}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("path", ATTENTION_EXAMPLES, ids=[p.name for p in ATTENTION_EXAMPLES])
def test_example_kernels_assemble_without_spills_at_their_primary_tile(path, arch):
    from mhadsl.codegen.backends import Layout, sm80
    for kernel in kernels_of(path):
        gqa = kernel.options.gqa or 1
        for ragged in (False, True):
            layout = Layout(gqa, ragged, kernel.options.return_lse)
            build = kernel.build(arch, gqa_group=gqa, ragged=ragged,
                                 return_lse=kernel.options.return_lse, backend="sm80")
            (res,) = build.assembled.kernels.values()
            assert res.spills == 0 and res.stack_bytes == 0, (kernel.name, ragged, res)
            primary, *fallbacks = sm80.build_configs(kernel.options, layout)
            narrow = (kernel.name, arch, ragged) in NARROW_TILE_BUILDS
            assert build.config == (fallbacks[0] if narrow else primary), \
                (kernel.name, ragged, build.config)


def test_default_scale_scheduler_and_options():
    (plain, fp16) = kernels_of(REPO / "examples/plain.mha")
    assert plain.options.scheduler == "Queued" and plain.options.dtype == "bf16"  # no mask
    masked = mhadsl.compile('import "std/schedulers.mha"\nattention c {\n'
                            '    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx\n}\n')["c"]
    # a mask: Queued or longest tiles first, by the batch; the backward takes LPT, a head at
    # a time
    assert masked.options.scheduler == "Adaptive"
    assert masked.options.scheduler_for("backward") == ("LPT", (("heads_per_section", 1),))
    assert plain.options.scheduler_for("backward") == ("Queued", ())
    # deterministic: Queued, whose orders hand out each head's K/V tiles in order; without a
    # mask interleaved, a head a section
    assert masked.options.scheduler_for("backward", deterministic=True) == ("Queued", ())
    assert plain.options.scheduler_for("backward", deterministic=True) == (
        "Queued", (("order", "INTERLEAVED"), ("heads_per_section", 1)))
    assert plain.options.softmax_scale() == pytest.approx(128 ** -0.5)
    assert fp16.options.softmax_scale() == 0.125 and fp16.options.return_lse
    assert fp16.options.scheduler == "Persistent"
    assert fp16.options.scheduler_args == (("order", "PROMPT_ROTATE"),)


@pytest.mark.parametrize("body, message", [
    ("head_dim = 96", "head_dim must be one of 64, 128, 256"),
    ("dtype = f32", "dtype must be one of bf16, fp16"),
    ("tile = (100, 64)", "tile sizes must be multiples of 16"),
    ("scheduler = Nope()", "scheduler must name a declared scheduler"),
    ("scheduler = Queued(bogus = 1)", "scheduler 'Queued' has no parameter 'bogus'"),
    ("mask(b, h, q_idx, kv_idx) = kv_idx", "'mask' returns bool, not i32"),
    ("mask(b, h, q_idx, kv_idx) = block_idx.x == 0", "'block_idx' is not available in mask"),
    ("score(s, b, h, q_idx, kv_idx) = s < 1.0", "'score' returns f32, not bool"),
    ("flavour = 3", "unknown attention setting 'flavour'"),
])
def test_attention_declaration_errors(body, message):
    with pytest.raises(mhadsl.MhaError) as info:
        mhadsl.compile(f'import "std/schedulers.mha"\nattention a {{\n  {body}\n}}\n', name="a.mha")
    assert message in str(info.value)
    assert str(info.value).startswith("a.mha:3:")


@pytest.fixture(scope="module")
def causal():
    return mhadsl.compile(REPO / "examples/causal.mha")["causal_fwd"]


def rand(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_one_build_serves_every_shape(causal):
    configs = {causal.specialize(rand(b, s, 4, 128), rand(b, s + 3, 4, 128), rand(b, s + 3, 4, 128))
               for b, s in [(1, 1), (2, 127), (3, 129), (1, 3000), (5, 64)]}
    assert len(configs) == 1
    gqa = causal.specialize(rand(1, 8, 8, 128), rand(1, 8, 2, 128), rand(1, 8, 2, 128))
    assert gqa.gqa_group == 4 and gqa not in configs


BAD_CALLS = [
    (lambda: (rand(1, 8, 4, 64), rand(1, 8, 4, 64), rand(1, 8, 4, 64)), {}, ValueError,
     "head dim 64, but kernel 'causal_fwd' is declared head_dim = 128"),
    (lambda: (rand(8, 4, 128), rand(8, 4, 128), rand(8, 4, 128)), {}, ValueError,
     "expected rank 4"),
    (lambda: (rand(1, 8, 6, 128), rand(1, 8, 4, 128), rand(1, 8, 4, 128)), {}, ValueError,
     "query heads (6) must be a multiple of key/value heads (4)"),
    (lambda: (rand(1, 8, 4, 128).astype(np.float64), rand(1, 8, 4, 128), rand(1, 8, 4, 128)), {},
     TypeError, "NumPy dtype float64 is not supported"),
    (lambda: ([[1.0]], rand(1, 8, 4, 128), rand(1, 8, 4, 128)), {}, TypeError,
     "expected a CUDA tensor"),
    (lambda: (rand(2, 8, 4, 128), rand(1, 8, 4, 128), rand(1, 8, 4, 128)), {}, ValueError,
     "q has batch 2 but k/v have 1"),
    (lambda: (rand(9, 4, 128), rand(9, 4, 128), rand(9, 4, 128)),
     {"cu_seqlens_q": np.array([0, 5, 9], np.int64), "cu_seqlens_k": np.array([0, 5, 9], np.int32)},
     TypeError, "cu_seqlens_q must be int32"),
    (lambda: (rand(9, 4, 128), rand(9, 4, 128), rand(9, 4, 128)),
     {"cu_seqlens_q": np.array([0, 6, 5], np.int32), "cu_seqlens_k": np.array([0, 5, 9], np.int32)},
     ValueError, "must be non-decreasing"),
    (lambda: (rand(9, 4, 128), rand(9, 4, 128), rand(9, 4, 128)),
     {"cu_seqlens_q": np.array([0, 5, 12], np.int32), "cu_seqlens_k": np.array([0, 5, 9], np.int32)},
     ValueError, "ends at 12, beyond the 9 rows"),
    (lambda: (rand(9, 4, 128), rand(9, 4, 128), rand(9, 4, 128)),
     {"cu_seqlens_q": np.array([0, 5, 9], np.int32)}, ValueError, "needs both cu_seqlens"),
    (lambda: (rand(1, 8, 4, 128), rand(1, 8, 4, 128), rand(1, 8, 4, 128)), {"scale": "big"},
     TypeError, "scale must be a finite number"),
    (lambda: (rand(1, 8, 4, 128), rand(1, 8, 4, 128), rand(1, 8, 4, 128)),
     {"out": np.zeros((1, 8, 4, 64), np.float32)}, ValueError, "out has shape"),
]


@pytest.mark.parametrize("make, kwargs, error, message", BAD_CALLS)
def test_bad_arguments_fail_before_any_launch(causal, monkeypatch, make, kwargs, error, message):
    from mhadsl.runtime import tensors
    touched = []
    monkeypatch.setattr(forward, "_launch", lambda *a, **k: touched.append("launch"))
    monkeypatch.setattr(tensors, "to_device", lambda *a, **k: touched.append("copy"))
    with pytest.raises(error) as info:
        causal(*make(), **kwargs)
    assert message in str(info.value)
    assert touched == []


def test_reference_api_matches_naive_softmax(causal):
    q, k, v = rand(1, 5, 2, 128), rand(1, 7, 2, 128) * 0.5, rand(1, 7, 2, 128)
    o = mhadsl.reference(causal, q, k, v)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(128)
    s = np.where(np.arange(7)[None, :] <= np.arange(5)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert np.allclose(o, np.einsum("bhqk,bkhd->bqhd", p, v), atol=1e-6)
