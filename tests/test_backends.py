"""The backend interface: target and design per compute capability (faked, no GPU needed),
and the backends' constraints as `check` diagnostics at the setting at fault."""
import re
import time
from dataclasses import replace

import pytest

import mhadsl
from helpers import REPO, STD, checked
from mhadsl.front.attention_spec import resolve_attention
from mhadsl.build import (
    KernelRequest, RequestError, build_block_classes, build_tile_index, plan,
)
from mhadsl.codegen import backends
from mhadsl.codegen.backends import (
    CacheLayout, DeviceTarget, Layout, select_backend, select_target,
)
from mhadsl.codegen.backends.sm80 import declared_config
from mhadsl.front.diagnostics import MhaError


@pytest.mark.parametrize("capability, target", [
    ((9, 0), DeviceTarget("sm_90a", "cubin")),  # sm_90a code runs on 9.0 only
    ((8, 0), DeviceTarget("sm_80", "cubin")),
    ((8, 6), DeviceTarget("sm_80", "cubin")),
    ((8, 9), DeviceTarget("sm_80", "cubin")),
    ((10, 0), DeviceTarget("sm_80", "ptx")),  # Blackwell: the driver JITs sm_80 PTX
    ((12, 0), DeviceTarget("sm_80", "ptx")),
])
def test_target_follows_the_compute_capability(capability, target):
    assert select_target(capability) == target
    backend, chosen = select_backend(capability)
    assert chosen == target and target.arch in backend.targets


def test_old_gpus_and_unknown_backends_are_refused():
    with pytest.raises(ValueError, match="8.0 or newer"):
        select_target((7, 5))
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_backend((9, 0), "nope")
    backend, _ = select_backend((8, 6), "sm80")  # a call may force a design
    assert backend.name == "sm80"


def test_kernel_parameters_come_from_the_backend():
    program = checked(STD + "attention a { head_dim = 64 }")
    resolved = plan(program, KernelRequest("a", "sm_80"))
    assert resolved.backend is backends.backend("sm80")
    names = [p.name for p in resolved.backend.abi]
    assert len(names) == len(set(names)) and {"q", "k", "v", "o", "queue"} <= set(names)
    shape = resolved.backend.scheduled(resolved.configs[0])
    assert (shape.threads, shape.shared_bytes) == (128, (128 + 2 * 64) * 64 * 2)


def test_bad_request_is_a_request_error():
    program = checked(STD + "attention a { head_dim = 64 }")
    with pytest.raises(RequestError, match="unknown GPU arch"):
        plan(program, KernelRequest("a", "sm_75"))
    with pytest.raises(RequestError, match="unknown attention backend"):
        plan(program, KernelRequest("a", "sm_80", backend="sm99"))


def _check_error(settings: str) -> MhaError:
    with pytest.raises(MhaError) as err:
        checked(STD + "attention a {\n" + settings + "\n}\n")
    return err.value


@pytest.mark.parametrize("settings, line, column, message", [
    ("    warps = 3", 3, 13, "runs 1, 2, 4 or 8 warps"),
    ("    tile = (16, 16)", 3, 12, "16-row pieces over 4 warps"),
    ("    tile = (16, 64)\n    warps = 8", 3, 12, "16-row pieces over 8 warps"),
    ("    warps = 8\n    tile = (16, 64)", 4, 12, "16-row pieces over 8 warps"),  # at the tile
    ("    stages = 9", 3, 14, "2-stage"),  # sm90 runs 1 to 8
    ("    head_dim = 256\n    warps = 4", 4, 13, "multiple of 8"),
    ("    head_dim = 256\n    tile = (128, 256)", 4, 12, "577 KiB of shared memory"),
    ("    head_dim = 256\n    tile = (256, 256)", 4, 12, "two or three consumer warpgroups take 128 or 192"),
])
def test_check_reports_what_the_backend_rejects(settings, line, column, message):
    err = _check_error(settings)
    found = [d for d in err.diagnostics if message in d.message]
    assert found, err.render()
    assert (found[0].span.line, found[0].span.column) == (line, column)


def test_a_declaration_no_design_runs_hears_what_each_design_refuses():
    """Each design's problems where it comes closest, at the settings at fault: sm80's
    stage count and sm90's tile rows, not one of them."""
    err = _check_error("    tile = (64, 256)\n    stages = 8")
    where = {d.message.split(": ", 1)[1]: (d.span.line, d.span.column)
             for d in err.diagnostics}
    assert where == {
        "stages = 8: the sm80 kernel has the 2-stage (FlashAttention-2) K/V pipeline": (4, 14),
        "a tile of 64 query rows: the sm90 kernel's two or three consumer warpgroups take "
        "128 or 192": (3, 12)}


def test_shared_memory_past_every_target_is_found_fast():
    start = time.perf_counter()
    err = _check_error("    head_dim = 256\n    tile = (128, 256)")
    assert time.perf_counter() - start < 10  # a check, not a 48 s compile
    assert "sm_90a allows 227 KiB" in err.render()


def test_a_declaration_one_target_runs_is_checked_per_build():
    """192 KiB of shared memory: fine on sm_90a (227 KiB), too much on sm_80 (163 KiB)."""
    program = checked(STD + "attention a {\n    head_dim = 256\n    tile = (128, 128)\n}\n")
    assert plan(program, KernelRequest("a", "sm_90a")).configs
    with pytest.raises(MhaError, match="sm_80 allows 163 KiB") as err:
        plan(program, KernelRequest("a", "sm_80"))
    assert err.value.diagnostics[0].span.line == 4


@pytest.fixture(scope="module")
def default_options():
    return resolve_attention(checked(STD + "attention a { }").attentions["a"])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("warps", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_m", [16, 64, 128, 192, 256])
@pytest.mark.parametrize("block_n", [16, 32, 64, 128, 256])
def test_what_the_backend_accepts_it_builds(default_options, head_dim, warps, block_m, block_n):
    """The design's constraints and its configs agree: every config of a declaration it
    accepts validates and fits the target's shared memory; one it refuses has no config."""
    options = replace(default_options, head_dim=head_dim, warps=warps, block_m=block_m,
                      block_n=block_n)
    sm80 = backends.backend("sm80")
    for arch in sm80.targets:
        if sm80.problems(options, arch):
            if not declared_config(options).problems():
                continue  # only the target's shared memory is short
            with pytest.raises(ValueError):
                sm80.configs(options, Layout())
            continue
        for config in sm80.configs(options, Layout()):
            config.validate()
            assert sm80.scheduled(config).shared_bytes <= backends.SHARED_MEMORY_LIMIT[arch]


def test_the_backward_and_sm90_look_for_kept_tiles_a_warp_at_a_time(monkeypatch, tmp_path):
    """Where the mask proves tiles empty, the backward designs find the next step that may
    hold a kept pair with `warp.first_true`: the warp's lanes classify 32 candidates at once
    and a ballot picks the first (the causal backward's K/V tile j skips the 2j query tiles
    above it; faster on the H200). The sm90 prefill finds a work tile's KV range so
    (`WorkTile.kv_range`); sm80 and decode ask one candidate per round
    (the warp's search moved sm80 builds onto fallback tiles)."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kern = mhadsl.compile(str(REPO / "examples" / "sliding_window.mha"))["sliding_window_256"]
    builds = {"sm90": kern.build("sm_90a"), "sm80": kern.build("sm_80"),
              "decode": kern.build("sm_90a", gqa_group=4, cache=CacheLayout(1, 0)),
              "backward_sm90": kern.backward_build("sm_90a"),
              "backward": kern.backward_build("sm_80")}
    for design, build in builds.items():
        assert build.backend == design
        together = "activemask.b32" in build.ptx and "vote.sync.ballot.b32" in build.ptx
        assert together == (design.startswith("backward") or design == "sm90"), design


@pytest.mark.parametrize("arch, design, kernel, roles", [
    ("sm_90a", "sm90", "mha_fwd_sm90", 2), ("sm_80", "sm80", "mha_fwd", 1)])
def test_ragged_tiles_take_the_keys_rows_from_the_queries_where_one_offsets_tensor_is_passed(
        arch, design, kernel, roles):
    """Self-attention passes one offsets tensor for Q and K: each role that runs a work tile
    compares the two pointers (`WorkTile._key_rows`) and reads cu_seqlens_k only where they
    differ; a dense build has no offsets to compare."""
    from mhadsl.build import build_kernel
    from mhadsl.codegen.backends import FORWARD_PARAMS
    program = mhadsl.compile(REPO / "examples" / "causal.mha")
    names = [p.name for p in FORWARD_PARAMS]

    def compares(layout):
        ptx = build_kernel(program.checked,
                           KernelRequest("causal_fwd", arch, design, layout)).ptx
        loads = [re.search(rf"ld\.param\.b64\s+(%rd\d+), \[{kernel}_param_{names.index(n)}\]",
                           ptx) for n in ("cu_seqlens_q", "cu_seqlens_k")]
        if not all(loads):  # (a dense build reads neither)
            return 0
        pair = {m.group(1) for m in loads}
        return sum(set(m.groups()) == pair for m in re.finditer(
            r"setp\.(?:eq|ne)\.b64\s+%p\d+, (%rd\d+), (%rd\d+);", ptx))
    assert compares(Layout(ragged=True)) == roles
    assert compares(Layout()) == 0


_GLOBAL_ACCESS = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:(?:ld|st|atom|red|cp|prefetch|multimem)\.(?!param|shared|local)"
    r"|mbarrier\.|wgmma\.)", re.M)


def _kernel_bodies(ptx: str) -> dict[str, str]:
    """Each `.entry` of PTX text, by name: its text up to the next entry."""
    parts = re.split(r"^\.visible \.entry (\w+)\(", ptx, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_hopper_kernels_let_the_next_grid_launch_and_wait_before_touching_memory():
    """Every kernel of the prefill and backward designs built for sm_90a begins with
    programmatic dependent launch's signal and wait (the runtime launches them while the
    grid before drains): no access to global or shared memory comes before the wait. sm_80
    builds have neither (their PTX also runs on GPUs the runtime launches plainly), nor
    have decode's (launched early, a step's kernels were slower)."""
    kern = mhadsl.compile(str(REPO / "examples" / "causal.mha"))["causal_fwd"]
    hopper = {"sm90": kern.build("sm_90a"),
              "sm80 design": kern.build("sm_90a", backend="sm80"),
              "backward_sm90": kern.backward_build("sm_90a")}
    for design, build in hopper.items():
        assert build.grid_dependent, design
        bodies = _kernel_bodies(build.ptx)
        assert bodies, design
        for name, body in bodies.items():
            signal = body.find("griddepcontrol.launch_dependents;")
            wait = body.find("griddepcontrol.wait;")
            assert 0 <= signal < wait, (design, name)
            first = _GLOBAL_ACCESS.search(body)
            assert first is not None and first.start() > wait, (design, name)
            assert body.count("griddepcontrol") == 2, (design, name)
    for plain in (kern.build("sm_80"), kern.build("sm_90a", gqa_group=4, cache=CacheLayout(
            1, 16, appends=True, balanced=True))):
        assert not plain.grid_dependent and "griddepcontrol" not in plain.ptx
    documents = mhadsl.compile(str(REPO / "examples" / "document_mask.mha"))
    for arch in ("sm_80", "sm_90a"):
        for small in (build_tile_index(arch), build_block_classes(
                documents.checked, "document_mask", ragged=False, arch=arch)):
            assert small.grid_dependent == (arch == "sm_90a")
            assert small.ptx.count("griddepcontrol.wait;") == small.grid_dependent
