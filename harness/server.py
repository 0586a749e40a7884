"""Start a real ComfyUI server on 127.0.0.1 and talk to it over its HTTP API and websocket.

Used by the server tests, the demo and the benchmarks. The server runs in its own process group and
is told to die with its parent (PR_SET_PDEATHSIG), so a killed test run or demo never leaves one behind.

Each server gets a private base directory (`--base-directory`, a temporary folder removed at stop) whose
custom_nodes/ holds only a link to the checkout this file belongs to, and whose models/ links to the
install's models/. So the server always runs the code of the repository the tests (or the demo) run from,
even when several checkouts (git worktrees) share one ComfyUI install, and it never touches that install's
own custom_nodes/ link. Images still go to the install's output/ (and inputs come from its input/); the
user settings and temp folders are the server's own.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import requests

from harness.comfy_host import REPO_ROOT, comfyui_path
from harness.pack_link import link_into


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ComfyServerError(RuntimeError):
    pass


class ComfyServer:
    """A ComfyUI `main.py --cpu` process with a small client for /prompt, /history and the websocket."""

    def __init__(self, root: Path | None = None, port: int | None = None, log_path: Path | None = None,
                 extra_args: list[str] | None = None, env: dict | None = None,
                 pack_dir: Path | None = REPO_ROOT) -> None:
        """`pack_dir`: the checkout the server loads as its only custom node pack (this repository by
        default); None runs the install as it is, with whatever its own custom_nodes/ holds."""
        self.root = Path(root) if root else comfyui_path()
        self.pack_dir = Path(pack_dir).resolve() if pack_dir is not None else None
        self.base_dir: Path | None = None
        self.pack_link: Path | None = None
        self.port = port or free_port()
        self.log_path = log_path or (REPO_ROOT / ".cache" / "logs" / f"comfyui-{self.port}.log")
        self.extra_args = extra_args or []
        self.env = env or {}
        self.client_id = uuid.uuid4().hex
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output_dir(self) -> Path:
        return self.root / "output"

    def _private_base(self) -> list[str]:
        """A base directory of this server's own: custom_nodes/ with the pack only, models/ shared."""
        self.base_dir = Path(tempfile.mkdtemp(prefix=f"comfyui-int8-accel-{self.port}-"))
        self.pack_link = link_into(self.base_dir / "custom_nodes", self.pack_dir)
        (self.base_dir / "models").symlink_to((self.root / "models").resolve(), target_is_directory=True)
        return ["--base-directory", str(self.base_dir), "--output-directory", str(self.output_dir),
                "--input-directory", str(self.root / "input"),
                "--database-url", f"sqlite:///{self.base_dir / 'comfyui.db'}"]

    def start(self, timeout: float = 180.0) -> ComfyServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        base_args = self._private_base() if self.pack_dir is not None else []
        cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--disable-auto-launch", *base_args, *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.process = subprocess.Popen(cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=_die_with_parent)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise ComfyServerError(f"ComfyUI exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/system_stats", timeout=2).ok:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise ComfyServerError(f"ComfyUI did not answer within {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        try:
            self._stop_process()
        finally:
            if self.base_dir is not None:
                shutil.rmtree(self.base_dir, ignore_errors=True)  # links are removed, never followed
                self.base_dir = None

    def _stop_process(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=15)

    def __enter__(self) -> ComfyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # --- HTTP API -------------------------------------------------------------------------------
    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(f"{self.url}{path}", timeout=kwargs.pop("timeout", 30), **kwargs)

    def object_info(self, node_class: str | None = None) -> dict:
        return self.get(f"/object_info/{node_class}" if node_class else "/object_info").json()

    def post_prompt(self, prompt: dict) -> requests.Response:
        return requests.post(f"{self.url}/prompt", json={"prompt": prompt, "client_id": self.client_id}, timeout=60)

    def drop_cached_outputs(self) -> None:
        """Make the next prompt execute every node: ComfyUI's /free with free_memory resets its output cache
        (and unloads models) once its worker wakes, which the request does at once; the pause lets it."""
        response = requests.post(f"{self.url}/free", json={"free_memory": True}, timeout=30)
        response.raise_for_status()
        time.sleep(1.0)

    def queue(self, prompt: dict) -> str:
        response = self.post_prompt(prompt)
        body = response.json()
        if response.status_code != 200 or body.get("node_errors"):
            raise ComfyServerError(f"prompt rejected ({response.status_code}): {json.dumps(body)[:2000]}")
        return body["prompt_id"]

    def history(self, prompt_id: str) -> dict:
        return self.get(f"/history/{prompt_id}").json().get(prompt_id, {})

    def connect(self):
        """A websocket on /ws for this client id (open it before queueing so no event is missed)."""
        import websocket

        return websocket.create_connection(f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}", timeout=5)

    def wait(self, prompt_id: str, timeout: float = 900.0,
             on_event: Callable[[dict], None] | None = None, ws=None) -> dict:
        """Follow the websocket until `prompt_id` finishes; return its /history entry plus the events seen."""
        import websocket

        ws = ws or self.connect()
        events: list[dict] = []
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                try:
                    message = ws.recv()
                except websocket.WebSocketTimeoutException:
                    if not self.alive():
                        raise ComfyServerError(f"ComfyUI died while running {prompt_id}:\n{self.log_tail()}") from None
                    status = self.history(prompt_id).get("status", {})
                    if status.get("completed") is not None and status.get("messages"):
                        events.extend({"type": kind, "data": data, "from_history": True}
                                      for kind, data in status["messages"] if kind not in
                                      {e["type"] for e in events})
                        break  # finished while we were not listening
                    continue
                if not isinstance(message, str):
                    continue  # binary preview frames
                event = json.loads(message)
                data = event.get("data", {})
                if data.get("prompt_id") not in (None, prompt_id):
                    continue
                events.append(event)
                if on_event:
                    on_event(event)
                if event["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                    break
            else:
                raise ComfyServerError(f"prompt {prompt_id} did not finish within {timeout} s")
        finally:
            ws.close()
        entry = {}
        for _ in range(100):  # history is written just after the final event
            entry = self.history(prompt_id)
            if entry.get("status", {}).get("completed") is not None:
                break
            time.sleep(0.1)
        return {"history": entry, "events": events}

    def run(self, prompt: dict, timeout: float = 900.0, on_event: Callable[[dict], None] | None = None) -> dict:
        ws = self.connect()
        try:
            prompt_id = self.queue(prompt)
        except Exception:
            ws.close()
            raise
        return self.wait(prompt_id, timeout=timeout, on_event=on_event, ws=ws)

    def output_images(self, history_entry: dict, kinds: tuple[str, ...] = ("output",)) -> list[Path]:
        """Files of the run's images of these `kinds`: by default the saved ones, not previews ("temp")."""
        paths = []
        for output in history_entry.get("outputs", {}).values():
            for image in output.get("images", []):
                kind = image.get("type", "output")
                if kind not in kinds:
                    continue
                folder = {"output": self.output_dir, "input": self.root / "input"}.get(
                    kind, (self.base_dir or self.root) / kind)
                paths.append(folder / image.get("subfolder", "") / image["filename"])
        return paths
