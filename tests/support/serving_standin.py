"""A stand-in for `python3 -m serving` (stdlib only), for testing gpu_proof/driver.py without a GPU or vLLM.

Reads PORT and CACHE_DIR like serving/launch.py; answers /ping after FAKE_DELAY_S seconds (0.05 when the
cache already holds vllm/compiled, as a baked cache would), /tokenize (a token per word), /detokenize,
streamed /v1/completions (max_tokens chunks of one token id each, the same ids for the same prompt and MODEL_DIR,
top logprobs when asked), /v1/chat/completions and /metrics (MTP counters).
"""

import json
import os
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CACHE = Path(os.environ["CACHE_DIR"])
WARM = (CACHE / "vllm" / "compiled").exists()
READY_AT = time.monotonic() + (0.05 if WARM else float(os.environ.get("FAKE_DELAY_S", "0.3")))
WEIGHTS = zlib.crc32(os.environ.get("MODEL_DIR", "").encode()) % 50  # other weights, other greedy ids
COUNTS = {"drafts": 0, "accepted": 0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def reply(self, payload, content_type="application/json", status=200):
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/ping":
            self.reply(
                {} if time.monotonic() >= READY_AT else {"error": "starting"},
                status=200 if time.monotonic() >= READY_AT else 503,
            )
        elif self.path == "/metrics":
            self.reply(
                f'vllm:spec_decode_num_drafts_total{{engine="0"}} {COUNTS["drafts"]}\n'
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {COUNTS["accepted"]}\n',
                "text/plain",
            )
        else:
            self.reply({"error": "not found"}, status=404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self.reply({"tokens": [len(w) for w in body["prompt"].split()]})
        elif self.path == "/detokenize":
            self.reply({"prompt": " ".join("w" * t for t in body["tokens"])})
        elif self.path == "/v1/chat/completions":
            self.reply({"choices": [{"message": {"content": "hi"}}]})
        elif self.path == "/v1/completions":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            seed = sum(len(w) for w in body["prompt"].split()) + WEIGHTS  # greedy: the same prompt, the same ids
            for position in range(body["max_tokens"]):
                token = (seed + position) % 50
                choice = {"text": " x", "token_ids": [token]}
                if body.get("logprobs"):
                    choice["logprobs"] = {"top_logprobs": [{f"token_id:{token}": -0.1, f"token_id:{token + 1}": -2.0}]}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            COUNTS["drafts"] += body["max_tokens"]
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        else:
            self.reply({"error": "not found"}, status=404)


def main() -> None:
    # what vLLM logs when it compiles, or loads what an earlier start compiled
    print("Directly load AOT compilation from path" if WARM else "torch.compile took 1.00 s in total", flush=True)
    (CACHE / "vllm").mkdir(parents=True, exist_ok=True)
    (CACHE / "vllm" / "compiled").write_text("graph")
    (CACHE / "triton").mkdir(exist_ok=True)
    (CACHE / "triton" / "kernel.cubin").write_text("kernel")
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()


if __name__ == "__main__":
    main()
