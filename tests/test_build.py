"""The one build path (mhadsl/build.py) and its on-disk cache: a key that cannot lie,
entries that survive concurrent writers, truncation and tampering, an unwritable cache;
and `mhadsl compile`'s use of both (the -o convention, errors without tracebacks)."""
import hashlib
import os
import struct
import subprocess
import sys
import textwrap
import warnings

import pytest

import mhadsl
from helpers import REPO, STD, checked, finishes_within
from mhadsl import build
from mhadsl.build import KernelRequest, cache_key, plan
from mhadsl.cli import main
from mhadsl.codegen import target as targets
from mhadsl.codegen import backends
from mhadsl.codegen.backends import Layout, sm80
from mhadsl.runtime import cache

SCHEDULER = """\
scheduler Strided(num_ctas: u32 = num_sms) {
    may_advance = true
    schedule    = DEFAULT

    grid_dim(batch_size, max_num_prompt_tiles) =
        (max(min(num_ctas, max_num_prompt_tiles * num_heads * batch_size), 1), 1, 1)

    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())

    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)

    advance(ts, state, pipeline_idx) {
        state.idx += grid_dim.x
        if state.idx >= state.max_idx { return none }
        return ts.seq_info(ts.work_info(state.idx, schedule))
    }

    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}
"""
KERNEL = 'import "sched.mha"\nattention a {\n    head_dim = 64\n    scheduler = Strided()\n}\n'

# Run in a child process: build kernel `a` of argv[1] without ptxas (fast) and print the
# PTX's hash.
CHILD = """
import hashlib, sys
import mhadsl, mhadsl.build
from mhadsl.codegen import backends
backends.find_ptxas = mhadsl.build._ptxas_version = lambda: None
ptx = mhadsl.compile(sys.argv[1])["a"].build("sm_80").ptx
print(hashlib.sha256(ptx.encode()).hexdigest())
"""


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def no_ptxas(monkeypatch):
    """PTX only: one candidate per build instead of ptxas's spill search (speed)."""
    monkeypatch.setattr(backends, "find_ptxas", lambda: None)
    monkeypatch.setattr(build, "_ptxas_version", lambda: None)
    monkeypatch.setattr("mhadsl.cli.find_ptxas", lambda: None)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "sched.mha").write_text(SCHEDULER)
    (tmp_path / "main.mha").write_text(KERNEL)
    return tmp_path


def entries(folder):
    return sorted(folder.rglob("*.entry"))


def test_editing_an_imported_file_rebuilds(project, cache_dir, no_ptxas):
    kernel = mhadsl.compile(project / "main.mha")["a"]
    first = kernel.build("sm_80")
    again = kernel.build("sm_80")
    assert (first.cached, again.cached, kernel.builds_compiled) == (False, True, 1)
    assert again.ptx == first.ptx
    (project / "sched.mha").write_text(SCHEDULER.replace("= DEFAULT", "= PROMPT_ROTATE"))
    edited = mhadsl.compile(project / "main.mha")["a"]
    rebuilt = edited.build("sm_80")
    assert not rebuilt.cached and rebuilt.ptx != first.ptx
    assert len(entries(cache_dir)) == 2


def test_key_covers_every_input(monkeypatch):
    program = checked(STD + "attention a { head_dim = 64 }")
    other = checked(STD + "attention a { head_dim = 64 }\n// edited\n")

    def key(prog=program, **request):
        req = KernelRequest("a", **{"arch": "sm_80", **request})
        return cache_key(prog, req, plan(prog, req))

    base = key()
    assert key() == base  # deterministic
    variants = [key(prog=other), key(arch="sm_90a"), key(ptx_version=84),
                key(layout=Layout(gqa_group=2)), key(layout=Layout(ragged=True)),
                key(layout=Layout(return_lse=True))]
    monkeypatch.setattr(cache, "compiler_hash", lambda: "another compiler")
    variants.append(key())
    monkeypatch.undo()
    monkeypatch.setattr(targets.llvm, "llvm_version_info", (1, 2, 3))
    variants.append(key())
    monkeypatch.setattr(build, "_ptxas_version", lambda: "ptxas 0.1")
    variants.append(key())
    assert len(set(variants + [base])) == len(variants) + 1


def test_compiler_hash_covers_its_sources(tmp_path, monkeypatch):
    package = tmp_path / "fakecompiler"
    (package / "std").mkdir(parents=True)
    files = {"__init__.py": "x = 1\n", "g.lark": "start: 'a'\n", "std/s.mha": "// s\n"}
    for name, text in files.items():
        (package / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cache, "COMPILER_PACKAGES", ("fakecompiler",))
    hashes = {cache.compiler_hash.__wrapped__()}
    for name in files:
        (package / name).write_text(files[name] + "// edited\n")
        hashes.add(cache.compiler_hash.__wrapped__())
    (package / "notes.txt").write_text("not part of the compiler")
    hashes.add(cache.compiler_hash.__wrapped__())
    assert len(hashes) == 1 + len(files)


def test_concurrent_builds_share_one_whole_entry(project, cache_dir, no_ptxas):
    env = {**os.environ, "MHADSL_CACHE_DIR": str(cache_dir)}
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(project / "main.mha")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env, cwd=REPO) for _ in range(8)]
    results = [child.communicate() for child in children]
    assert all(child.returncode == 0 for child in children), results
    hashes = {out.strip() for out, _ in results}
    assert len(hashes) == 1
    assert len(entries(cache_dir)) == 1
    assert not [p for p in cache_dir.rglob("*") if p.name.startswith(".tmp-")]
    kernel = mhadsl.compile(project / "main.mha")["a"]
    loaded = kernel.build("sm_80")
    assert loaded.cached and hashlib.sha256(loaded.ptx.encode()).hexdigest() in hashes


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "rewrite whole but foreign"])
def test_damaged_entry_is_detected_and_rebuilt(project, cache_dir, no_ptxas, damage):
    kernel = mhadsl.compile(project / "main.mha")["a"]
    good = kernel.build("sm_80")
    (entry,) = entries(cache_dir)
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "flip a byte":
        at = data.index(b".entry mha_fwd") + 3  # inside the PTX
        entry.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    else:  # a valid entry, but not one this build path wrote: no metadata
        cache.CompileCache().put(entry.stem, {"ptx": b"// not a kernel"})
    rebuilt = kernel.build("sm_80")
    assert not rebuilt.cached and rebuilt.ptx == good.ptx and kernel.builds_compiled == 2
    assert kernel.build("sm_80").cached  # the rebuild replaced the entry with a whole one


def test_unwritable_cache_builds_in_memory_with_one_warning(project, tmp_path, monkeypatch,
                                                             no_ptxas):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    kernel = mhadsl.compile(project / "main.mha")["a"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        builds = [kernel.build("sm_80"), kernel.build("sm_80", return_lse=True)]
    assert all(b.ptx and not b.cached for b in builds)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "not writable" in messages[0], messages


def test_api_can_force_a_backend(project, cache_dir, no_ptxas):
    kernel = mhadsl.compile(project / "main.mha")["a"]
    assert kernel.build("sm_80", backend="sm80").backend == "sm80"
    with pytest.raises(build.RequestError, match="unknown attention backend"):
        kernel.build("sm_80", backend="sm99")


# ---------------------------------------------------------------- the CLI
def compile_cli(capsys, *args):
    code = main(["compile", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_second_compile_loads_from_the_cache(project, cache_dir, no_ptxas, capsys,
                                             monkeypatch):
    code, first, _ = compile_cli(capsys, project / "main.mha", "--arch", "sm_80")
    assert code == 0 and "mha_fwd" in first

    def generate(*_):
        raise AssertionError("the kernel was generated again")
    monkeypatch.setattr(sm80, "build_attention_module", generate)
    code, second, err = compile_cli(capsys, project / "main.mha", "--arch", "sm_80")
    assert code == 0 and second == first, err


def test_output_conventions(project, cache_dir, no_ptxas, capsys):
    main_mha = project / "main.mha"
    out_dir = project / "out"
    out_dir.mkdir()
    assert compile_cli(capsys, main_mha, "--kernel", "a", "-o", out_dir)[0] == 0
    assert ".entry mha_fwd" in (out_dir / "a.ptx").read_text()  # one unit into a folder
    assert compile_cli(capsys, main_mha, "--kernel", "a", "-o", project / "k.ptx")[0] == 0
    assert ".entry mha_fwd" in (project / "k.ptx").read_text()  # one unit to a file
    code, _, err = compile_cli(capsys, main_mha, "-o", project / "both.ptx")
    assert code == 2 and not (project / "both.ptx").exists()
    assert err.count("\n") == 1 and "--kernel" in err and "-o DIR/" in err
    assert compile_cli(capsys, main_mha, "-o", project / "units")[0] == 0
    assert sorted(p.name for p in (project / "units").iterdir()) == ["a.ptx", "schedulers.ptx"]


@pytest.mark.parametrize("where, why", [("missing/k.ptx", "does not exist"),
                                        ("sched.mha/k.ptx", "is not a folder")])
def test_output_in_no_folder_is_one_line(project, capsys, where, why):
    code, _, err = compile_cli(capsys, project / "main.mha", "-o", project / where)
    assert code == 2 and err.count("\n") == 1 and why in err and "Traceback" not in err


def test_compile_reports_backend_limits_like_check(tmp_path, capsys):
    bad = tmp_path / "bad.mha"
    bad.write_text(STD + "attention a {\n    tile = (16, 64)\n    warps = 8\n}\n")
    code, _, err = compile_cli(capsys, bad)
    assert code == 1 and f"{bad}:3:12: error: attention 'a'" in err
    assert "Traceback" not in err


def test_a_build_for_a_target_the_declaration_does_not_fit(tmp_path, cache_dir, capsys):
    fits_sm90 = tmp_path / "big.mha"
    fits_sm90.write_text(STD + textwrap.dedent("""\
        attention a {
            head_dim = 256
            tile = (128, 128)
        }
        """))
    code, _, err = compile_cli(capsys, fits_sm90, "--arch", "sm_80", "--kernel", "a")
    assert code == 1 and ":4:12: error:" in err and "sm_80 allows 163 KiB" in err


def _forged(header: bytes, payload: bytes = b"") -> bytes:
    """An entry in the cache's format with a valid digest: one not written by the cache."""
    body = struct.pack("<I", len(header)) + header + payload
    return cache._MAGIC + hashlib.sha256(body).digest() + body


MALFORMED = {
    "a FIFO": lambda entry: os.mkfifo(entry),
    "a link to /dev/zero": lambda entry: entry.symlink_to("/dev/zero"),
    "header not JSON": lambda entry: entry.write_bytes(_forged(b"\xff{", b"ptx")),
    "header an object": lambda entry: entry.write_bytes(_forged(b'{"ptx": 3}', b"ptx")),
    "header nested deep": lambda entry: entry.write_bytes(_forged(b"[" * 100_000)),
    "negative size": lambda entry: entry.write_bytes(_forged(b'[["ptx", -3]]', b"ptx")),
    "size past the end": lambda entry: entry.write_bytes(_forged(b'[["ptx", 99]]', b"ptx")),
    "name not a string": lambda entry: entry.write_bytes(_forged(b'[[1, 3]]', b"ptx")),
    "a folder": lambda entry: (entry / "inside").mkdir(parents=True),
}


@pytest.mark.parametrize("make", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_entry_is_a_miss_never_a_hang_or_traceback(tmp_path, make):
    store = cache.CompileCache(tmp_path)
    key = cache.cache_key(what="malformed entry")
    entry = store._path(key)
    entry.parent.mkdir(parents=True)
    make(entry)
    assert finishes_within(5, lambda: store.get(key)) is None
    store.put(key, {"ptx": b"whole"})  # replaces it
    assert store.get(key) == {"ptx": b"whole"}


def test_a_build_whose_entry_is_a_fifo_rebuilds(project, cache_dir, no_ptxas):
    kernel = mhadsl.compile(project / "main.mha")["a"]
    good = kernel.build("sm_80")
    (entry,) = entries(cache_dir)
    entry.unlink()
    os.mkfifo(entry)
    rebuilt = finishes_within(60, lambda: kernel.build("sm_80"))
    assert not rebuilt.cached and rebuilt.ptx == good.ptx


def test_an_entry_replaced_by_a_folder_is_replaced_by_the_next_build(project, cache_dir,
                                                                     no_ptxas):
    kernel = mhadsl.compile(project / "main.mha")["a"]
    good = kernel.build("sm_80")
    (entry,) = entries(cache_dir)
    entry.unlink()
    (entry / "inside").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would say the cache stopped storing
        rebuilt = kernel.build("sm_80")
        again = mhadsl.compile(project / "main.mha")["a"].build("sm_80")
    assert not rebuilt.cached and rebuilt.ptx == good.ptx
    assert again.cached and entry.is_file()


def test_a_folder_reached_through_a_link_out_of_the_cache_is_left_alone(tmp_path):
    """Only what lies inside the cache folder is removed to store an entry."""
    store = cache.CompileCache(tmp_path / "cache")
    key = cache.cache_key(what="linked entry folder")
    outside = tmp_path / "outside"
    (outside / f"{key}.entry").mkdir(parents=True)
    (outside / f"{key}.entry" / "keep").write_text("not the cache's")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / key[:2]).symlink_to(outside)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        store.put(key, {"ptx": b"whole"})
    assert (outside / f"{key}.entry" / "keep").read_text() == "not the cache's"
