"""mhadsl.host.bench's timing, on the CPU: a stand-in for torch whose CUDA events read a clock
that the timed functions advance."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mhadsl.host.bench import kernel_times, time_ms, time_side_by_side


class FakeGpu:
    """torch.cuda with events on a simulated clock (milliseconds)."""

    def __init__(self):
        self.clock = 0.0
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = gpu.clock

            def elapsed_time(self, end):
                return end.at - self.at

        self.cuda = SimpleNamespace(Event=Event, synchronize=lambda: None)

    def kernel(self, ms, log=None, name=None):
        def run():
            self.clock += ms() if callable(ms) else ms
            if log is not None:
                log.append(name)
        return run


def test_time_ms_is_the_median_of_the_timed_runs():
    gpu = FakeGpu()
    durations = iter([9.0] * 5 + [1.0, 2.0, 3.0, 100.0, 4.0])  # 5 warm-up runs, then timed
    assert time_ms(gpu, gpu.kernel(lambda: next(durations)), warmup=5, reps=5) == 3.0


def test_side_by_side_times_each_function_in_turn_from_a_new_first_each_round():
    """Each round starts from the next function; odd rounds take the others in reverse, so
    each function follows a different one from round to round."""
    gpu = FakeGpu()
    log = []
    fns = {"a": gpu.kernel(1.0, log, "a"), "b": gpu.kernel(2.0, log, "b"), "none": None,
           "c": gpu.kernel(3.0, log, "c")}
    times = time_side_by_side(gpu, fns, rounds=3, warmup=1, reps=2)
    assert times["none"] is None
    assert {n: t.ms for n, t in times.items() if t} == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert all(len(t.round_ms) == 3 for t in times.values() if t)
    blocks = [log[i] for i in range(0, len(log), 3)]  # each function runs 1 + 2 times a turn
    assert blocks == ["a", "b", "c", "b", "a", "c", "c", "a", "b"]


def test_side_by_side_ratios_follow_a_drifting_gpu():
    """The GPU slows down over the run: timed one after the other, the second function
    would look slower; timed in turn, each round's ratio is the true one."""
    gpu = FakeGpu()
    slowdown = lambda: 1.0 + gpu.clock / 1000.0  # noqa: E731
    fns = {"ours": gpu.kernel(lambda: 1.0 * slowdown()),
           "theirs": gpu.kernel(lambda: 1.0 * slowdown())}
    times = time_side_by_side(gpu, fns, rounds=8, warmup=0, reps=10)
    for ours, theirs in zip(times["ours"].round_ms, times["theirs"].round_ms):
        assert ours == pytest.approx(theirs, rel=0.02)
    assert times["ours"].ms == pytest.approx(times["theirs"].ms, rel=0.02)


class FakeProfiler:
    """torch with a profiler whose CUDA events come from the timed function: each call
    launches `kernels` ((name, µs or a function giving them) pairs) after `gaps` (µs of
    idle time before each)."""

    def __init__(self, kernels, gaps):
        self.kernels, self.gaps, self.clock, self.events = kernels, gaps, 0.0, []
        fake = self
        self.autograd = SimpleNamespace(DeviceType=SimpleNamespace(CUDA="cuda"))
        self.cuda = SimpleNamespace(synchronize=lambda: None)

        class Profile:
            def __init__(self, activities):
                assert activities == ["cuda"]

            def __enter__(self):
                fake.events = []
                return self

            def __exit__(self, *exc):
                return False

            def events(self):
                host = SimpleNamespace(name="cudaLaunchKernel", device_type="cpu",
                                       time_range=SimpleNamespace(start=0.0, end=1.0))
                return [host, *reversed(fake.events)]  # any order: sorted by start

        self.profiler = SimpleNamespace(profile=Profile,
                                        ProfilerActivity=SimpleNamespace(CUDA="cuda"))

    def call(self):
        for (name, us), gap in zip(self.kernels, self.gaps):
            start = self.clock + gap
            self.clock = start + (us() if callable(us) else us)
            self.events.append(SimpleNamespace(name=name, device_type="cuda",
                                               time_range=SimpleNamespace(start=start,
                                                                          end=self.clock)))


def test_kernel_times_are_each_kernels_median_and_the_idle_time_before_it():
    decode = iter([300.0, 300.0, 900.0, 300.0, 310.0, 290.0])  # a warm-up call, then 5
    gpu = FakeProfiler([("splits", 2.5), ("decode", lambda: next(decode))], [1.5, 1.25])
    times = kernel_times(gpu, gpu.call, calls=5)
    assert list(times) == ["splits", "decode", "gap before decode", "gap before splits"]
    assert times == {"splits": 2.5, "decode": 300.0, "gap before decode": 1.25,
                     "gap before splits": 1.5}


def test_hopper_benchmark_refuses_rows_it_does_not_have():
    """`benchmarks/hopper.py --only` names declarations; an unknown one is an error before
    anything needs a GPU."""
    script = Path(__file__).parent.parent / "benchmarks" / "hopper.py"
    done = subprocess.run([sys.executable, str(script), "--only", "window,nope"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--only: no rows for nope" in done.stderr and "window" in done.stderr


def test_hopper_benchmark_row_gives_ratios_by_medians_and_rounds(capsys):
    """A row of `benchmarks/hopper.py`: TFLOP/s from each column's median, and sm90's ratio
    to a peer as the medians' with the lowest and highest of the rounds' ratios; a column
    that did not run is a dash."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    try:
        import hopper
    finally:
        sys.path.pop(0)
    from mhadsl.host.bench import Problem, Timing
    times = {"sm80": Timing(2.0, (2.0, 2.0)), "sm90": Timing(1.0, (1.0, 0.5)),
             "flash": None, "cudnn": Timing(1.1, (1.2, 0.6)), "flex": None,
             "fa4": Timing(0.9, (0.8, 1.0))}
    hopper.print_row("causal_d64 (run 2/3)", Problem(4, 4096, 4096, 32, 32, 64), 2e12, times,
                     [2e-3, 2.1e-3])
    cells = [c.strip() for c in capsys.readouterr().out.split("|")[1:-1]]
    assert cells[0] == "causal_d64 (run 2/3)"
    assert cells[2:8] == ["1000", "2000", "—", "1818", "—", "2222"]
    assert cells[8] == "1.100x (1.20–1.20)" and cells[9] == "0.900x (0.80–2.00)"


def test_hopper_benchmark_refuses_fewer_than_one_run():
    script = Path(__file__).parent.parent / "benchmarks" / "hopper.py"
    done = subprocess.run([sys.executable, str(script), "--runs", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--runs 0: at least 1" in done.stderr


def test_operands_benchmark_compares_like_with_like():
    """`benchmarks/operands.py`: each run-time row's kernel reads exactly the scalars the row
    passes, and its constant twin reads none; a ratio is the peer's time over ours, run by
    run, its median first."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    try:
        import operands
    finally:
        sys.path.pop(0)
    import mhadsl
    kernels = dict(mhadsl.compile(operands.CONSTANTS, name="operands.mha"))
    kernels["runtime_window"] = mhadsl.compile(
        Path(__file__).parent.parent / "examples" / "runtime_window.mha")["runtime_window"]
    for _, runtime, scalars, constant, _ in operands.RUNTIME_ROWS:
        assert {o.name for o in kernels[runtime].options.operands} == set(scalars)
        assert kernels[constant].options.operands == ()
    assert operands.speedup([1.0, 2.0, 1.0], [1.1, 1.8, 1.0]) == "1.00× (0.90–1.10)"
    assert operands.speedup(None, [1.0]) == "—"
