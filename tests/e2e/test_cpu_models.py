"""The kernel class rolloutd picks by itself on CPUs other than the one the tests run on.

--cpu-kernels avx2|scalar (scripts/golden_each_kernel.sh) runs an older CPU's kernels on this one,
but it skips the detection: which class the cpuid bits select, and whether anything the daemon runs
before or beside its kernels uses an instruction the CPU lacks. QEMU's user-mode emulator answers
cpuid as a named CPU model would, so the daemon's detection sees that CPU, and QEMU 7.2 implements
no AVX-512 instruction, so one run anywhere in the daemon kills it with SIGILL (QEMU does run AVX2
instructions even for a model without AVX2: there the case checks the detection and the scalar
kernels' answers, not the absence of AVX2 code). Each case here starts

    qemu-x86_64 -cpu MODEL build/rolloutd ...        (--cpu-kernels auto, the default)

checks the class the daemon logs against the one that CPU must get, and runs test_golden's BF16
and FP8 checks on the qwen3 fixture against transformers' references:

    EPYC-Milan   AMD Zen 3: AVX2, FMA, F16C, no AVX-512  -> avx2, FP8 kernel avx2-exact
    Nehalem      SSE4.2, no AVX                          -> scalar, FP8 kernel generic-exact

The emulator is Debian's qemu-user (scripts/install-deps.sh installs it); without it, or off
x86-64, the cases skip saying so. Speed under the emulator means nothing; only the answers count.
"""
import pathlib
import platform
import re
import shutil
import stat

import pytest

import conftest
import test_golden

QEMU = shutil.which("qemu-x86_64")
FIXTURE = "qwen3"
CPU_MODELS = [
    ("EPYC-Milan", "cpu: avx2 fma f16c; fp8 kernel avx2-exact"),
    ("Nehalem", "cpu: scalar C; fp8 kernel generic-exact"),
]


def sanitized(path):
    """Whether the daemon binary is built with AddressSanitizer: such a build does not get through
    its start under qemu-user (`--help` printed nothing in 120 s)."""
    try:
        return b"__asan_init" in pathlib.Path(path).read_bytes()
    except OSError:
        return False


pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the emulated CPU models are x86-64"),
    pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 (Debian's qemu-user) is not installed"),
    pytest.mark.skipif(not (test_golden.MODELS / FIXTURE / "golden.json").is_file(),
                       reason=f"fixture {FIXTURE} is missing"),
    pytest.mark.skipif(sanitized(conftest.BIN), reason="an ASan build does not start under qemu-user"),
]


@pytest.fixture
def emulated(tmp_path):
    """emulated(cpu_model) -> a start(model_dir, *args) for test_golden's tests that runs the daemon
    under qemu-x86_64 -cpu cpu_model with --cpu-kernels auto; started: the daemons, in order.

    The daemons are killed at the end, not stopped with SIGTERM as conftest's fixture does: under QEMU
    7.2 (Debian 12's qemu-user) a signal handler starts on a stack 8 bytes off the 16-byte alignment
    the x86-64 ABI promises, and libuv's handler crashes at its first aligned SSE store (a core dump
    shows movaps to 0x10(%rsp) with rsp = 8 mod 16). The daemon's SIGTERM drain is tested natively
    (test_generate_api.py's test_signal_drains_in_flight, and every daemon conftest stops)."""
    started = []

    def make(cpu_model):
        wrapper = tmp_path / f"rolloutd-{cpu_model}"
        # exec: the daemon is the process that is killed at the end. RS_FP8_ROW_TILE_MIN: the start's
        # timing of few-row against padded FP8 tiles would measure the emulator (7 s of a 12 s start
        # under it); 5 is what it picks on the Xeon with the AVX2 kernels. Both forms still run.
        wrapper.write_text(f'#!/bin/sh\nRS_FP8_ROW_TILE_MIN=5 exec {QEMU} -cpu {cpu_model} {conftest.BIN} "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)

        def start(model_dir, *args):
            native, conftest.BIN = conftest.BIN, str(wrapper)
            try:
                d = conftest.Daemon(model_dir, [*args, "--cpu-kernels", "auto"],
                                    tmp_path / f"rolloutd-{len(started)}.log")
            finally:
                conftest.BIN = native
            started.append(d)
            return d
        return start

    make.started = started
    yield make
    for d in started:
        d.proc.kill()
        d.proc.wait()
        d.log.close()


def logged_class(d):
    m = re.search(r"cpu: [^;]*; fp8 kernel [a-z0-9-]+", d.read_log())
    assert m, f"the daemon logged no kernel class:\n{d.read_log()[-2000:]}"
    return m.group(0)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("cpu_model,want", CPU_MODELS, ids=[m for m, _ in CPU_MODELS])
def test_detected_class_and_golden(emulated, cpu_model, want, precision):
    start, started = emulated(cpu_model), emulated.started
    if precision == "bf16":
        test_golden.test_golden(start, FIXTURE, "default")
    else:
        test_golden.test_golden_fp8(start, FIXTURE, FIXTURE, "default")
    assert len(started) == 1
    d = started[0]
    assert d.proc.poll() is None, \
        f"the daemon ended under -cpu {cpu_model} ({d.proc.returncode}):\n{d.read_log()[-2000:]}"
    assert logged_class(d) == want, f"under -cpu {cpu_model}"
