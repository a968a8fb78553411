"""End-to-end test fixtures: start the real rolloutd binary on a free loopback port.

`rolloutd(model_dir=None, *args)` starts a daemon (the embedded default model when model_dir is
None), waits until GET /health answers 200, and returns a Daemon with .url and .proc. Every daemon
is stopped with SIGTERM at the end of the test and must exit 0: a crash anywhere fails the test.
ROLLOUTD_ARGS="--flag value ..." adds flags to every daemon (scripts/gpu-check.sh runs end-to-end
tests with "--device cuda"); a test's own flags come after them and win.
"""
import os
import pathlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("ROLLOUTD_BIN", str(ROOT / "build" / "rolloutd"))
FIXTURES = ROOT / "tests" / "fixtures"
EXTRA_ARGS = shlex.split(os.environ.get("ROLLOUTD_ARGS", ""))


def read_answer(s):
    """(status, headers with lower-case names, body) of one Content-Length-framed HTTP answer read
    from socket s."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    top, rest = data.split(b"\r\n\r\n", 1)
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = s.recv(65536)
        assert chunk, data
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:n]


_venv_skips = {}  # venv name -> why it cannot be had, once found out


def tool_venv(name, spec, probe):
    """The python of build/NAME, a throwaway venv with the pip requirements `spec` (space-separated)
    installed (from PyPI, once; later runs reuse it), where running `probe` (Python code) succeeds.
    It is installed into a temporary venv renamed into place, so an interrupted install leaves
    nothing half-done.
    Where it cannot be had, the calling test skips, saying why (and so does every later caller)."""
    if name in _venv_skips:
        pytest.skip(_venv_skips[name])
    venv = ROOT / "build" / name
    python = venv / "bin" / "python"

    def works():
        return python.exists() and subprocess.run([str(python), "-c", probe], capture_output=True,
                                                  timeout=120).returncode == 0

    if works():
        return python
    tmp = venv.with_name(f"{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, capture_output=True, timeout=120)
        subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *spec.split()], check=True, capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        out = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip()
        _venv_skips[name] = f"{spec} could not be installed from PyPI into a venv ({e}): {out[-400:]}"
        pytest.skip(_venv_skips[name])
    shutil.rmtree(venv, ignore_errors=True)
    os.replace(tmp, venv)  # the venv's python resolves its prefix from pyvenv.cfg: a moved venv works
    if not works():
        _venv_skips[name] = f"{spec} installed, but `{probe}` fails in its venv"
        pytest.skip(_venv_skips[name])
    return python


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, model_dir, args, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [BIN, "--host", "127.0.0.1", "--port", str(self.port), "--threads", "2"]
        if model_dir is not None:
            cmd += ["--model", str(model_dir)]
        cmd += EXTRA_ARGS + [str(a) for a in args]
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rolloutd exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError(f"rolloutd did not become healthy:\n{self.read_log()}")

    def read_log(self):
        if not self.log.closed:
            self.log.flush()
        return pathlib.Path(self.log_path).read_text(errors="replace")

    def post(self, path, body=None, **kw):
        kw.setdefault("timeout", 300)
        if isinstance(body, (bytes, str)):
            return requests.post(self.url + path, data=body, **kw)
        return requests.post(self.url + path, json=body, **kw)

    def get(self, path, **kw):
        kw.setdefault("timeout", 60)
        return requests.get(self.url + path, **kw)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("rolloutd did not exit within 60 s of SIGTERM")
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def rolloutd(tmp_path):
    started = []

    def start(model_dir=None, *args):
        d = Daemon(model_dir, args, tmp_path / f"rolloutd-{len(started)}.log")
        started.append(d)
        return d

    yield start
    for d in started:
        rc = d.stop()
        assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"
