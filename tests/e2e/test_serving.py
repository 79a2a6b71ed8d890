"""serving/ in the serve venv and on real servers (one at a time): Triton's autotuning switch, fork_start's reason,
the CPU plugins' math, and the tiny variants served through `python -m serving`, well and badly asked
(tests/unit/test_serving.py: the middleware and the launch against stand-ins)."""

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, SERVE_JSON, SERVE_PY, host_server

sys.path.insert(0, str(ROOT))
from serving import patches  # noqa: E402
from serving.settings import SERVE  # noqa: E402
from unit.test_serving import MSG

# the Triton that vLLM brings reads the variable child_env sets: its autotuner then caches to disk
TRITON_KNOB = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from serving.launch import KEEP_AUTOTUNING
os.environ.update(KEEP_AUTOTUNING)
from triton import knobs
print(json.dumps({"cache": bool(knobs.autotuning.cache)}))
"""


@pytest.mark.e2e
def test_the_serving_venvs_triton_reads_the_autotuning_switch(tiny_venvs):
    out = subprocess.run(
        [str(tiny_venvs["serve-cpu"]), "-c", TRITON_KNOB, str(ROOT)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"cache": True}


FORK_AFTER_POOL = r"""
import os, sys, time, torch
sys.path.insert(0, sys.argv[1])
from serving.patches.fork_start import fork_refusal
torch.set_num_threads(2)
if sys.argv[2] == "pool":
    (torch.ones(4_000_000) * 2).sum()  # a parallel region: GNU OpenMP starts its thread pool here
print(fork_refusal({}, True, torch.get_num_threads(), set()), flush=True)
pid = os.fork()
if pid == 0:
    (torch.ones(4_000_000) * 3).sum()
    os._exit(0)
for _ in range(50):  # the child takes well under a second when it works
    if os.waitpid(pid, os.WNOHANG)[0]:
        print("child finished"); break
    time.sleep(0.1)
else:
    os.kill(pid, 9); print("child hung")
"""


@pytest.mark.e2e
def test_a_child_forked_after_an_openmp_thread_pool_hangs_and_fork_start_refuses_that_parent():
    """Why fork_start keeps its parents on one OpenMP thread: with torch's GNU OpenMP, a child forked after a
    parallel region waits forever at its own first one."""
    runs = {}
    for parent in ("no-pool", "pool"):
        r = subprocess.run(
            [str(SERVE_PY), "-c", FORK_AFTER_POOL, str(ROOT), parent], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
        runs[parent] = r.stdout.split("\n")
    assert runs["pool"][1] == "child hung" and runs["no-pool"][1] == "child finished", runs
    assert "runs 2 OpenMP threads" in runs["pool"][0] and "runs 2 OpenMP threads" in runs["no-pool"][0]


# ---------- int4 dequant (needs the serve-cpu venv) ----------

DEQUANT_CHECK = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from vllm.scalar_type import scalar_types
from serving.patches.int4_fallback import dequantize
torch.manual_seed(0)
out, inp, g = 64, 96, 32
q = torch.randint(-8, 8, (out, inp), dtype=torch.int8)
scale = torch.rand(out, inp // g, dtype=torch.bfloat16) + 0.1
w = dequantize(pack_to_int32(q, 4), scale, None, scalar_types.uint4b8, inp)
ref = (q.float() * scale.float().repeat_interleave(g, 1)).bfloat16()
assert w.dtype == torch.bfloat16 and w.shape == (out, inp) and torch.equal(w, ref), (w - ref).abs().max()
qa = torch.randint(-8, 8, (out, inp), dtype=torch.int8); zp = torch.randint(-8, 8, (out, inp // g), dtype=torch.int8)
w = dequantize(pack_to_int32(qa, 4), scale, pack_to_int32(zp, 4, packed_dim=0), scalar_types.uint4, inp)
ref = ((qa.float() - zp.float().repeat_interleave(g, 1)) * scale.float().repeat_interleave(g, 1)).bfloat16()
assert torch.equal(w, ref)
g_idx = torch.randint(0, inp // g, (inp,), dtype=torch.int32)  # activation order: any column in any group
w = dequantize(pack_to_int32(q, 4), scale, None, scalar_types.uint4b8, inp, g_idx)
assert torch.equal(w, (q.float() * scale.float()[:, g_idx.long()]).bfloat16())
from serving.patches.spec_expand_fix import expand
out = torch.full((4,), -7, dtype=torch.int32)
expand(out, torch.tensor([20, 5], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32), 0, 0)
assert out.tolist() == [20, 5, 5, -7], out
out = torch.zeros(3)
expand(out, torch.tensor([-1.0, 0.5]), torch.tensor([2, 3]), -1, 1)
assert out.tolist() == [1.0, 1.0, 0.5], out
print("ok")
"""


@pytest.mark.e2e
def test_cpu_plugins_math():
    r = subprocess.run([str(SERVE_PY), "-c", DEQUANT_CHECK, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# What the int4 and fp32 plugins do follows from one fact of the serve venv on this CPU: vLLM loads `_C` (with the
# int4 GEMM `cpu_gemm_wna16`) on a CPU with AVX-512 BF16 and `_C_AVX2` (without it) elsewhere. The check below runs
# both ways on any x86 CPU: as vLLM loads its kernels here, and with the AVX2 library forced (what a CPU without
# AVX-512 gets), so both plugins are exercised on an AVX-512 host too.
INT4_CHECK = r"""
import sys, types, torch
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "avx2":
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
import vllm._custom_ops  # noqa: F401  (loads the platform's kernels, as the plugin's own check does)
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel as K
from vllm.scalar_type import scalar_types
import serving.patches.int4_fallback as plugin
import serving.patches.avx2_fp32 as fp32_plugin
import vllm.model_executor.layers.utils as layer_utils
from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d, gdn_attention
has_op = hasattr(torch.ops._C, "cpu_gemm_wna16")
plugin.register()  # through the registry's guard: both switched on (the tiny profile's serve.patches)
fp32_plugin.register()
patched = getattr(K, "_dequant_fallback", False)
assert patched == (not has_op), (has_op, patched)
fp32 = getattr(layer_utils.dispatch_cpu_unquantized_gemm, "fp32_linear", False)
assert fp32 == patched, (fp32, patched)
conv_patched = [isinstance(m.F, fp32_plugin.FunctionalWithFp32Conv) for m in (causal_conv1d, gdn_attention)]
assert conv_patched == [fp32, fp32], conv_patched
torch.manual_seed(0)
if fp32:  # a bf16 linear layer and a bf16 depthwise convolution, computed in fp32 and rounded to bf16
    layer = torch.nn.Module()
    w = torch.randn(48, 96, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight.numel() == 0
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    y = layer_utils.cpu_unquantized_gemm(layer, x, layer.weight)
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.nn.functional.linear(x.float(), w.float()).bfloat16())
    conv_in, conv_w = torch.randn(1, 64, 7, dtype=torch.bfloat16), torch.randn(64, 1, 4, dtype=torch.bfloat16)
    out = gdn_attention.F.conv1d(conv_in, conv_w, None, groups=64)
    ref = torch.nn.functional.conv1d(conv_in.float(), conv_w.float(), None, groups=64).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert gdn_attention.F.silu is torch.nn.functional.silu  # everything else is torch's own
    # the GDN prefill of packed sequences, each starting from its slot of a state pool that the kernel updates in
    # place (vLLM 0.32), against vLLM's kernel (which keeps some intermediates in bf16, hence a tolerance of bf16's
    # rounding); slot 1 belongs to no sequence and stays as it was
    lens, kv_heads, v_heads, dim = [70, 1, 130], 2, 4, 64
    tokens, seqs = sum(lens), len(lens)
    q, k = (torch.randn(1, tokens, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, tokens, v_heads, dim, dtype=torch.bfloat16)
    g, beta = -torch.rand(1, tokens, v_heads) * 0.3, torch.rand(1, tokens, v_heads, dtype=torch.bfloat16)
    cu = torch.tensor([0, 70, 71, 201], dtype=torch.int32)
    pool = torch.randn(seqs + 1, v_heads, dim, dim) * 0.1
    slots = torch.tensor([3, 0, 2], dtype=torch.int32)
    rule = dict(query=q, key=k, value=v, g=g, beta=beta, output_final_state=True, cu_seqlens=cu, head_first=False,
                use_qk_l2norm_in_kernel=True, initial_state_indices=slots)
    assert gdn_attention.ops.chunk_gated_delta_rule_cpu is fp32_plugin.chunk_gated_delta_rule_fp32
    mine, ref_pool = pool.clone(), pool.clone()
    out, final = gdn_attention.ops.chunk_gated_delta_rule_cpu(initial_state=mine, **rule)
    ref_out, _ = torch.ops._C.chunk_gated_delta_rule_cpu(q, k, v, g, beta, ref_pool, True, cu, False, True, slots)
    assert out.dtype == ref_out.dtype and final.shape == (seqs, v_heads, dim, dim)
    assert (out.float() - ref_out.float()).abs().max() < 0.02 * ref_out.float().abs().max(), "prefill output"
    assert (mine - ref_pool).abs().max() < 0.02 * ref_pool.abs().max(), "final states, written to their slots"
    assert torch.equal(mine[1], pool[1]) and not torch.equal(mine[3], pool[3]), "only the sequences' slots change"
    assert torch.equal(final, mine[slots.long()]), "the returned states are the pool's"
    heads_first = {**rule, **{n: rule[n].transpose(1, 2) for n in ("query", "key", "value", "g", "beta")}}
    mine_hf = pool.clone()
    out_hf, _ = gdn_attention.ops.chunk_gated_delta_rule_cpu(
        initial_state=mine_hf, **{**heads_first, "head_first": True}
    )
    assert torch.equal(out_hf, out.transpose(1, 2)) and torch.equal(mine_hf, mine), "head_first layout"
else:
    assert gdn_attention.ops.chunk_gated_delta_rule_cpu.__module__ == "vllm._custom_ops"
if patched:  # the patched kernel on a layer as vLLM leaves it after loading computes the dense matmul
    torch.manual_seed(0)
    out, inp, g = 64, 96, 32
    q = torch.randint(-8, 8, (out, inp), dtype=torch.int8)
    scale = torch.rand(out, inp // g, dtype=torch.bfloat16) + 0.1
    kernel = K.__new__(K)
    kernel.w_q_name, kernel.w_s_name, kernel.w_zp_name, kernel.w_gidx_name = "weight_packed", "weight_scale", None, None
    kernel.config = types.SimpleNamespace(zero_points=False, has_g_idx=False, weight_type=scalar_types.uint4b8)
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(pack_to_int32(q, 4), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.input_size_per_partition = inp
    kernel.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight_packed") and not hasattr(layer, "weight_scale")
    x = torch.randn(3, inp, dtype=torch.bfloat16)
    dense = (q.float() * scale.float().repeat_interleave(g, 1)).bfloat16()  # the weights as bf16 would hold them
    ref = torch.nn.functional.linear(x.float(), dense.float()).bfloat16()
    assert torch.equal(kernel.apply_weights(layer, x), ref)
print(f"has_op={has_op} fallback={patched} fp32={fp32}")
"""


def int4_check(kernels: str) -> dict:
    r = subprocess.run(
        [str(SERVE_PY), "-c", INT4_CHECK, str(ROOT), kernels],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **{patches.ENV: "int4_fallback,avx2_fp32"}),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("has_op=")][-1]  # vLLM may log to stdout too
    return dict(field.split("=") for field in line.split())


_INT4_GEMM = {}


def serve_venv_has_int4_gemm() -> bool:
    """Whether vLLM in the serve venv has its int4 GEMM on this CPU (AVX-512 BF16: yes; AVX2 only: no)."""
    if not _INT4_GEMM:
        _INT4_GEMM["native"] = int4_check("native")["has_op"] == "True"
    return _INT4_GEMM["native"]


@pytest.mark.e2e
def test_avx2_plugins_stay_out_where_the_op_exists_and_serve_where_it_does_not():
    native = int4_check("native")
    assert native["fallback"] == native["fp32"] == str(native["has_op"] != "True")
    _INT4_GEMM["native"] = native["has_op"] == "True"
    avx2 = int4_check("avx2")  # vLLM's AVX2 kernel library never has the op: the fallback takes over
    assert avx2 == {"has_op": "False", "fallback": "True", "fp32": "True"}


# ---------- real servers (one at a time) ----------


def http(port, path, body=None, timeout=300):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
        return r.status, (json.loads(raw) if raw.startswith("{") else raw)


BASE = SERVE_JSON
# One server, as the tiny profile ships it (W4A16 weights with the MTP drafter, prefix caching off as with MTP
# there, its CPU-only patches on): the entrypoint, middleware and vLLM's endpoints do not depend on the weights'
# format, and every other combination is served by the pipeline's own stages (bake, probe, gate, lossless reference)
# in the same session.
TINY = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
TINY_PATCHES = TINY["variants"][TINY["variant"]]["serve"]["patches"]
VARIANTS = {
    "w4a16-mtp1-eager": (
        "tiny_quantized",
        {
            "enable_prefix_caching": False,
            "patches": TINY_PATCHES,
            "speculative": {"method": "mtp", "k": 1},
            "body_timeout_s": 5,  # a stalled body's 408 comes soon (every other test sends its body at once)
        },
    ),
}


NEEDS = sorted({fixture for fixture, _ in VARIANTS.values()})  # for the scheduler's ordering (module_rank)


@pytest.fixture(scope="module", params=list(VARIANTS))
def server(request, tmp_path_factory):
    fixture, overrides = VARIANTS[request.param]
    model = request.getfixturevalue(fixture)  # built by the pipeline's own rules
    tmp = tmp_path_factory.mktemp(request.param)
    with host_server(model, {**BASE, **overrides}, tmp) as base:
        yield int(base.rsplit(":", 1)[1]), request.param, tmp / "server.log"


NAME = BASE["served_model_name"]


def rendered(port, path, body):
    status, r = http(port, path, {**body, "return_prompt_text": True})
    assert status == 200
    return r["prompt_text"], r


@pytest.mark.e2e
def test_completions(server):
    port, *_ = server
    status, r = http(
        port,
        "/v1/completions",
        {"model": NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0},
    )
    assert status == 200 and r["choices"][0]["index"] == 0
    assert isinstance(r["choices"][0]["text"], str) and 1 <= r["usage"]["completion_tokens"] <= 8
    # sampled requests too (under MTP on CPU they need serving.patches.spec_expand_fix)
    status, s = http(
        port,
        "/v1/completions",
        {"model": NAME, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8, "top_k": 20, "top_p": 0.9},
    )
    assert status == 200 and s["usage"]["completion_tokens"] >= 1
    # greedy is deterministic
    assert (
        http(
            port,
            "/v1/completions",
            {"model": NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0},
        )[1]["choices"][0]["text"]
        == r["choices"][0]["text"]
    )


@pytest.mark.e2e
def test_chat_thinking_off_by_default_on_when_asked(server):
    port, *_ = server
    body = {"model": NAME, "messages": MSG, "max_tokens": 8, "temperature": 0.0}
    off, r = rendered(port, "/v1/chat/completions", body)
    assert off.endswith("<think>\n\n</think>\n\n"), off[-80:]
    assert isinstance(r["choices"][0]["message"]["content"], str)
    for on_body in ({**body, "thinking": True}, {**body, "chat_template_kwargs": {"enable_thinking": True}}):
        on, _ = rendered(port, "/v1/chat/completions", on_body)
        assert "</think>" not in on and on.rstrip().endswith("<think>"), on[-80:]


@pytest.mark.e2e
def test_chat_streaming(server):
    port, *_ = server
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps({"model": NAME, "messages": MSG, "max_tokens": 8, "temperature": 0.0, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        lines = [ln.decode().strip() for ln in r if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert len(chunks) >= 2 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert any(ch["delta"].get("content") for c in chunks for ch in c["choices"])


def stream_text(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        lines = [ln.decode().strip() for ln in r if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    return text, [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]


@pytest.mark.e2e
def test_thinking_budget_closes_a_capped_thought(server):
    port, *_ = server
    body = {"model": NAME, "messages": MSG, "max_tokens": 24, "temperature": 0.0, "thinking": True}
    status, r = http(port, "/v1/chat/completions", body)
    content = r["choices"][0]["message"]["content"]
    # The random tiny model never closes a thought by itself: the budget did, 8 tokens before the cap.
    assert status == 200 and "</think>" in content, content
    assert r["usage"]["completion_tokens"] <= 24 and r["choices"][0]["finish_reason"] in {"length", "stop"}
    text, finishes = stream_text(port, body)
    assert text == content and len(finishes) == 1  # greedy: the stream tells the same story, one end
    off, _ = stream_text(port, {**body, "thinking": False})
    assert off.count("</think>") == 0  # thinking off: the template closed the block, nothing is added


@pytest.mark.e2e
def test_invocations(server):
    port, *_ = server
    status, r = http(port, "/invocations", {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0})
    assert status == 200 and isinstance(r["choices"][0]["text"], str)
    status, r = http(port, "/invocations", {"prompt": "Hello", "max_tokens": 4, "thinking": True})
    assert status == 200 and "text" in r["choices"][0]
    body = {"messages": MSG, "max_tokens": 4, "temperature": 0.0}
    off, r = rendered(port, "/invocations", body)
    assert isinstance(r["choices"][0]["message"]["content"], str) and off.endswith("</think>\n\n")
    on, _ = rendered(port, "/invocations", {**body, "thinking": True})
    assert "</think>" not in on


@pytest.mark.e2e
def test_metrics_and_plugin(server):
    port, variant, log = server
    status, text = http(port, "/metrics")
    assert status == 200 and "vllm:" in text
    if "mtp" in variant:  # the draft model really proposed tokens
        drafted = [ln for ln in text.splitlines() if ln.startswith("vllm:spec_decode_num_draft_tokens_total")]
        assert drafted and float(drafted[0].split()[-1]) > 0, drafted
    if variant.startswith("w4a16"):
        # The plugin dequantizes only where vLLM has no int4 GEMM on this CPU (AVX2); with AVX-512 the op serves.
        fell_back = "int4 fallback: no cpu_gemm_wna16" in log.read_text()
        assert fell_back == (not serve_venv_has_int4_gemm()), fell_back
        assert "Using CPUWNA16LinearKernel" in log.read_text()  # vLLM's own int4 kernel class either way


def _tcp_inodes(port: int) -> set[str]:
    """Socket inodes of this machine's TCP sockets on `port` (local address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


@pytest.mark.e2e
def test_engine_core_and_worker_are_forked_bound_and_hold_no_server_port(server):
    port, _, log = server
    text = log.read_text()
    assert "fork start: the engine core is forked, not spawned" in text
    assert "fork start: the worker is forked, not spawned" in text
    bound = re.search(r"fork start: VllmWorker-0 bound to cpus \[([\d, ]+)\], (\d+) OpenMP threads", text)
    assert bound, text[-3000:]
    cpus = {int(x) for x in bound.group(1).split(",")}
    # vLLM keeps a CPU for the engine core where it can, and the worker really runs on the CPUs the log names
    assert len(cpus) == max(1, len(os.sched_getaffinity(0)) - 1) == int(bound.group(2))
    worker = int(re.search(r"\(Worker pid=(\d+)\)", text).group(1))
    assert os.sched_getaffinity(worker) == cpus
    held = {os.readlink(f"/proc/{worker}/fd/{fd}") for fd in os.listdir(f"/proc/{worker}/fd")}
    assert not {f"socket:[{inode}]" for inode in _tcp_inodes(port)} & held  # the HTTP port stays the API server's
    status, _ = http(port, "/ping")
    assert status == 200


# ---------- abuse: every bad request gets a 4xx (or a clean stream end) and the server keeps serving ----------


def raw_post(port, path, data: bytes, timeout=120):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as error:
        return error.code


ABUSE = {
    "malformed json": ("/v1/chat/completions", b'{"model": "x", "messages": [', {400, 422}),
    "malformed json, invocations": ("/invocations", b'{"prompt": "hi", "max_tokens": ', {400, 422}),
    "malformed json, completions": ("/v1/completions", b"not json at all", {400, 422}),
    # past Python's recursion limit: the middleware's json.loads must not make a 500 of it
    "json nested too deep": (
        "/v1/chat/completions",
        b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        {400, 422},
    ),
    "no messages": ("/v1/chat/completions", {"model": NAME, "max_tokens": 4}, {400, 422}),
    "no prompt": ("/v1/completions", {"model": NAME, "max_tokens": 4}, {400, 422}),
    "max_tokens 0": ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 0}, {400, 422}),
    "max_tokens negative": ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": -5}, {400, 422}),
    "max_tokens huge": ("/v1/chat/completions", {"model": NAME, "messages": MSG, "max_tokens": 10**9}, {400, 422}),
    "negative temperature": (
        "/v1/completions",
        {"model": NAME, "prompt": "hi", "max_tokens": 4, "temperature": -1.0},
        {400, 422},
    ),
    "prompt over max_model_len": (
        "/v1/completions",
        {"model": NAME, "prompt": "word " * 4 * BASE["max_model_len"], "max_tokens": 4},
        {400, 422},
    ),
    "thinking kwargs not a dict": (
        "/v1/chat/completions",
        {"model": NAME, "messages": MSG, "max_tokens": 4, "thinking": True, "chat_template_kwargs": "on"},
        {400, 422},
    ),
    # vLLM ignores fields it does not know (and logs them): served, not a crash
    "unknown fields": ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 4, "frobnicate": 1}, {200}),
}


def still_serves(port):
    assert http(port, "/ping", timeout=30)[0] == 200
    # ignore_eos: the trained tiny model may well end a bare prompt at once; serving means tokens come out
    status, r = http(
        port,
        "/v1/completions",
        {"model": NAME, "prompt": "One two three", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
    )
    assert status == 200 and r["usage"]["completion_tokens"] == 4, r


@pytest.mark.e2e
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    port, *_ = server
    answers = {}
    for case, (path, body, _) in ABUSE.items():
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        answers[case] = raw_post(port, path, data)
    wrong = {case: code for case, code in answers.items() if code not in ABUSE[case][2]}
    assert not wrong, wrong
    still_serves(port)


@pytest.mark.e2e
def test_client_that_leaves_mid_stream_does_not_hurt_the_server(server):
    port, *_ = server
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        body = json.dumps(
            {
                "model": NAME,
                "messages": MSG,
                "max_tokens": 200,
                "stream": True,
                "chat_template_kwargs": {"enable_thinking": True},
            }
        ).encode()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert b"200" in sock.recv(4096).split(b"\r\n", 1)[0]  # the stream has started; now hang up
    still_serves(port)


@pytest.mark.e2e
def test_eight_concurrent_streaming_thinking_chats_all_complete(server):
    from concurrent.futures import ThreadPoolExecutor

    port, *_ = server

    def stream_chat(i):
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
            "max_tokens": 24,
            "stream": True,
            "thinking": True,
            "temperature": 0.0,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            lines = [line.decode().strip() for line in r if line.strip()]
        return lines[-1], sum(1 for line in lines if line.startswith("data: {"))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream_chat, range(8)))
    assert all(last == "data: [DONE]" for last, _ in results), results
    assert all(chunks > 1 for _, chunks in results), results


def oversized_request(port: int, limit: int) -> bytes:
    """The status line answering a chat request that declares a body one byte over `limit` and sends 64 KiB of it."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {limit + 1}\r\n\r\n".encode()
            + b"x" * 65536
        )
        return sock.recv(4096).split(b"\r\n", 1)[0]


@pytest.mark.e2e
def test_a_stalled_body_is_answered_408_and_its_connection_closed(server):
    """Through vLLM's own HTTP server: the middleware's 408 goes out and the connection is dropped, so the rest of
    the body is never read, and the server serves on."""
    port, *_ = server
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        answer = b""
        while chunk := sock.recv(4096):  # ends when the server closes the connection
            answer += chunk
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"408", answer
    assert b"body_timeout_s" in answer, answer
    still_serves(port)


@pytest.mark.e2e
def test_seven_streams_beside_an_oversized_request_answer_as_each_alone(server):
    """The bounds at work among others: a body over max_request_bytes is answered 413 without the rest being read,
    while seven greedy thinking streams (the budget's continuation included) answer as each did alone."""
    from concurrent.futures import ThreadPoolExecutor

    port, *_ = server
    bodies = [
        {
            "model": NAME,
            "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
            "max_tokens": 16,
            "thinking": True,
            "temperature": 0.0,
        }
        for i in range(7)
    ]
    alone = [stream_text(port, body) for body in bodies]
    limit = BASE.get("max_request_bytes", SERVE["max_request_bytes"].default)
    with ThreadPoolExecutor(8) as pool:
        abusive = pool.submit(oversized_request, port, limit)
        together = list(pool.map(lambda body: stream_text(port, body), bodies))
    assert abusive.result().split()[1] == b"413", abusive.result()
    assert together == alone
    assert all(finishes for _, finishes in alone), alone
    still_serves(port)
