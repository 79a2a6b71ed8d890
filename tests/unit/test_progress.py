"""Progress lines (lib/progress.py): every long wait or loop says what it is doing at least every
PROGRESS_INTERVAL_S; here with a short interval so the lines appear in a test."""

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from lib import containers, progress, stage
from quality_gate import GateProgress, counting


def test_the_interval_is_a_module_constant_of_30_s_at_most():
    assert 0 < progress.PROGRESS_INTERVAL_S <= 30
    assert progress.Heartbeat(lambda s: "").interval_s == progress.PROGRESS_INTERVAL_S


def test_heartbeat_prints_while_the_block_runs_and_stops_after(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.05)
    lines = []
    clock = iter(range(0, 10_000, 7))  # a fake clock: every reading 7 "seconds" later
    with progress.Heartbeat(lambda s: f"busy for {s:.0f} s", log=lines.append, clock=lambda: next(clock)):
        time.sleep(0.4)
    count = len(lines)
    time.sleep(0.15)
    assert count >= 3 and len(lines) == count  # nothing after the block
    assert lines[0] == "busy for 7 s" and lines[1] == "busy for 14 s"


def test_a_failing_description_never_stops_the_work(monkeypatch):
    lines = []

    def broken(seconds):
        raise RuntimeError("docker logs hung")

    with progress.Heartbeat(broken, interval_s=0.02, log=lines.append):
        time.sleep(0.1)
    assert lines and "progress unavailable: RuntimeError: docker logs hung" in lines[0]
    with pytest.raises(ValueError):
        progress.Heartbeat(broken, interval_s=0)


def test_lines_also_reach_the_console_when_the_output_goes_to_a_log(monkeypatch):
    read, write = os.pipe()
    monkeypatch.setenv(stage.CONSOLE_FD_ENV, str(write))
    logged = []
    with progress.Heartbeat(lambda s: "still waiting", interval_s=0.02, log=logged.append):
        time.sleep(0.1)
    os.close(write)
    console = os.read(read, 10_000).decode()
    os.close(read)
    assert logged and console.splitlines()[0] == "still waiting"


def test_elapsed_reads_like_a_person_would_write_it():
    assert progress.elapsed(12.7) == "12 s" and progress.elapsed(95) == "1 min 35 s"


# ---- wait_for_ping: what it waits for, how long, vLLM's last log line --------------------------------------


def test_wait_for_ping_says_what_it_waits_for_every_interval(monkeypatch, capsys):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if time.monotonic() >= ready_at else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.1)
    ready_at = time.monotonic() + 0.7
    try:
        containers.wait_for_ping(
            url,
            timeout_s=10,
            interval_s=0.05,
            what="container bake-1",
            logs=lambda: "INFO starting\nINFO Compiling a graph for dynamic shape\n",
        )
    finally:
        server.shutdown()
        server.server_close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[wait_for_ping]")]
    assert len(lines) >= 3
    assert f"waiting for container bake-1 to answer {url}/ping" in lines[0]
    assert " s of 10 s" in lines[0] and "HTTP 503" in lines[-1]
    assert lines[-1].endswith("last log line: INFO Compiling a graph for dynamic shape")


# ---- the quality gate: tasks done, requests answered ----------------------------------------------------


def test_gate_progress_counts_answered_requests_sync_and_async():
    class Model:
        def model_call(self, messages, **kwargs):
            return {"answer": messages}

        async def amodel_call(self, session, sem, messages, **kwargs):
            return [messages]

    state = GateProgress(["mmlu_pro", "ifeval", "gpqa_diamond"])
    state.start("mmlu_pro")
    model = counting(Model, state)()
    assert model.model_call("q1") == {"answer": "q1"}
    assert asyncio.run(model.amodel_call(None, None, "q2")) == ["q2"]
    state.finish()
    state.start("ifeval")
    model.model_call("q3")
    line = state.line(75)
    assert line.startswith("[quality_gate] 1/3 tasks done; task ifeval: 1 requests answered in")
    assert line.endswith("1 min 15 s in all")
    assert counting(Model, state).__name__ == "CountingModel"


def test_gate_progress_lines_appear_during_a_task(monkeypatch):
    state = GateProgress(["tiny_mc"])
    state.start("tiny_mc")
    lines = []
    with progress.Heartbeat(state.line, interval_s=0.02, log=lines.append):
        for _ in range(5):
            state.answered()
            time.sleep(0.03)
    assert lines and all(line.startswith("[quality_gate] 0/1 tasks done; task tiny_mc:") for line in lines)
    assert "5 requests answered" in lines[-1] or "4 requests answered" in lines[-1]


def test_the_model_download_says_how_much_has_arrived_every_interval(monkeypatch, tmp_path, capsys):
    """download's snapshot of ~9 GB runs for minutes: a line every interval with the bytes written so far."""
    import hashlib
    import types

    import download

    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.05)
    files = {"config.json": b"{}", "model.safetensors": b"\0" * 3_000_000}

    def snapshot_download(repo_id, revision, local_dir):
        for name, data in files.items():
            time.sleep(0.3)
            (Path(local_dir) / name).write_bytes(data)
        time.sleep(0.3)

    listing = [
        types.SimpleNamespace(
            path=name, size=len(data), blob_id=hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        )
        for name, data in files.items()
    ]
    api = types.SimpleNamespace(list_repo_tree=lambda repo, revision, recursive: listing)
    fake_hub = types.SimpleNamespace(HfApi=lambda: api, snapshot_download=snapshot_download)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake_hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    dest = tmp_path / "checkpoint"
    dest.mkdir()
    download.fetch_hub("org/model", "c" * 40, dest)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[download] ")]
    assert lines and all(line.startswith(f"[download] org/model@{'c' * 12}: ") for line in lines), lines
    assert lines[0].endswith("0.0 MB after 0 s") and lines[-1].endswith("3.0 MB after 0 s"), lines
