"""vLLM general plugin (entry point in _dist/): the Gated DeltaNet prefill of a step that prefills one request alone,
replayed from a CUDA graph once a layer has seen its length before.

Why it exists: on an H200 with vLLM 0.32 (bf16, Qwen3.5-4B's shapes, in-process engine) a request's first token took
50-70 ms whatever its length, a 1-token prompt included (0.32 classifies a first chunk as a prefill). A torch profiler
trace of a 64-token prefill: the GPU busy 5 ms of it, each of the 24 GDN layers 3.4 ms of host time in
`vllm::qwen_gdn_attention_core` on the Triton prefill path (the only GDN prefill of the contract's A10G): Python
around a dozen launches (FLA's autotuner, heuristics and launcher, input guards) and the initial state's gather,
boolean-mask zeroing (`initial_state[~prefill_has_initial_state, ...] = 0`: a `nonzero`, a host sync) and scatter.
Replayed, a layer took 0.32 ms, and the 64-token first step 27 ms instead of 70 (docs/results.md, the prefill
table), with every token's id and logprob unchanged on the trained tiny checkpoint.

What it does, for a step whose GDN metadata is one request's prefill (no decodes, no drafts, `num_prefills == 1`) of
at most MAX_TOKENS rows: the second time a layer sees a length, it captures the prefill branch of vLLM's
`_forward_core` in a CUDA graph (vLLM's own kernels in vLLM's order: causal_conv1d_fn, fused_post_conv_prep, the
layer's chunk_gated_delta_rule, the state's gather and scatter; the zeroing as `masked_fill`, the same values without
the sync a capture cannot hold), on static inputs shared by every layer and one private memory pool. From then on a
step copies its inputs, state slots and has-state flags in, replays, and copies the output out. The competition's
prompts repeat and its 5 warm-ups capture them; a length seen once (most fresh prompts) runs vLLM's own code and
costs a dictionary look-up. Every other step (a length not seen before, longer chunks, decodes, drafts, several
prefills, FlashInfer/CuteDSL/AITER backends, a capture in progress) runs vLLM's own code unchanged. A capture that
fails turns the graphs off for the process (logged).

serve.patches.gdn_prefill_graphs: false leaves vLLM's code alone; gpu_proof/floor.py --ab measures a prefill both
ways in one engine and compares every token's logprob.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from serving.patches import guarded

_WRAPPED = "_serving_gdn_prefill_graphs"
_LAYER_STATE = "_serving_prefill_graphs"
# A prefill chunk of more rows runs vLLM's own code: there the GPU's work outweighs the host's launches, while a graph's
# memory (its inputs and pool, shared by the layers) grows with the length: ~0.2 GB at 2,048 tokens of Qwen3.5-4B.
MAX_TOKENS = 2048
MIN_SIGHTINGS = 2  # a length is captured the second time a layer sees it: a length seen once costs no capture
MAX_LENGTHS = 8  # lengths with a graph per layer; more stay eager (bounds the graphs' memory)
MAX_COUNTED = 4096  # lengths counted before the counts start over (fresh prompts of many lengths)


def one_prefill(metadata) -> tuple[int, int, int] | None:
    """(rows, prompt tokens, requests) when the step's GDN metadata is one request's prefill alone, the only batch
    this patch takes, else None: rows is what vLLM's branch slices its inputs to (num_actual_tokens), requests counts
    the zero-length padding requests a runner may append (their slots and flags travel with the real one's)."""
    if metadata is None or metadata.spec_sequence_masks is not None:
        return None
    if metadata.num_prefills != 1 or metadata.num_decodes or metadata.num_spec_decodes:
        return None
    if getattr(metadata, "aiter_prefill_metadata", None) is not None:
        return None
    starts, slots = metadata.prefill_query_start_loc, metadata.prefill_state_indices
    if starts is None or slots is None or metadata.chunk_indices is None or metadata.chunk_offsets is None:
        return None
    # without decodes vLLM's builder hands the chunk kernel the non-speculative tensors themselves, and the model runner
    # V2's update_block_table (the other KV-cache groups) a view of the same slots
    if not (
        starts is metadata.non_spec_query_start_loc
        and same_view(slots, metadata.non_spec_state_indices_tensor)
        and metadata.prefill_has_initial_state is metadata.has_initial_state
    ):
        return None
    requests = slots.numel()
    if requests < 1 or starts.numel() != requests + 1 or metadata.has_initial_state.numel() != requests:
        return None
    if metadata.nums_dict is None:
        return None
    rows, tokens = int(metadata.num_actual_tokens), int(metadata.num_prefill_tokens)
    if tokens < 1 or rows < tokens:
        return None
    return rows, tokens, requests


def same_view(tensor, other) -> bool:
    """Whether two tensors are the same elements of the same storage (a slice from 0 of the whole is the whole)."""
    return other is not None and (
        tensor is other
        or (tensor.data_ptr() == other.data_ptr() and tensor.shape == other.shape and tensor.stride() == other.stride())
    )


def prefill_branch(layer, mixed_qkv, b, a, core_attn_out, metadata, rows: int) -> None:
    """vLLM 0.32's `_forward_core` for one request's prefill, kernel for kernel, with the initial state of a request
    without one zeroed by `masked_fill` instead of a boolean-mask assignment (which syncs the host). Writes
    core_attn_out[:rows] and the layer's conv and recurrent states."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    conv_state = layer.kv_cache[0] if gdn.is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    ssm_state = layer.kv_cache[1]
    conv_weights = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(2))
    convolved = gdn.causal_conv1d_fn(
        mixed_qkv[:rows].transpose(0, 1),
        conv_weights,
        layer.conv1d.bias,
        activation=layer.activation,
        conv_states=conv_state,
        has_initial_state=metadata.has_initial_state,
        cache_indices=metadata.non_spec_state_indices_tensor,
        query_start_loc=metadata.non_spec_query_start_loc,
        metadata=metadata,
    ).transpose(0, 1)
    query, key, value, g, beta = gdn.fused_post_conv_prep(
        conv_output=convolved,
        a=a[:rows],
        b=b[:rows],
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        num_k_heads=layer.num_k_heads // layer.tp_size,
        head_k_dim=layer.head_k_dim,
        head_v_dim=layer.head_v_dim,
        apply_l2norm=True,
        output_g_exp=False,
    )
    slots = metadata.prefill_state_indices
    initial_state = ssm_state[slots]
    has_state = metadata.prefill_has_initial_state.view(-1, *([1] * (initial_state.dim() - 1)))
    initial_state = initial_state.masked_fill(~has_state, 0)  # vLLM's boolean-mask assignment, without its nonzero
    output, last_state = layer.chunk_gated_delta_rule(
        q=query.unsqueeze(0),
        k=key.unsqueeze(0),
        v=value.unsqueeze(0),
        g=g.unsqueeze(0),
        beta=beta.unsqueeze(0),
        initial_state=initial_state,
        output_final_state=True,
        cu_seqlens=metadata.prefill_query_start_loc,
        chunk_indices=metadata.chunk_indices,
        chunk_offsets=metadata.chunk_offsets,
        use_qk_l2norm_in_kernel=False,
        aiter_prefill_metadata=None,
    )
    ssm_state[slots] = last_state.to(ssm_state.dtype)
    core_attn_out[:rows] = output.squeeze(0)


@dataclass
class Inputs:
    """A length's static tensors, shared by every layer's graph of that length (the layers run one after another on
    one stream): the step's inputs and per-step metadata are copied in, the output copied out."""

    mixed_qkv: object
    b: object
    a: object
    out: object
    metadata: object  # the step's GDN metadata with every tensor the branch reads replaced by a static copy

    def fill(self, mixed_qkv, b, a, metadata, rows: int) -> None:
        self.mixed_qkv.copy_(mixed_qkv[:rows])
        self.b.copy_(b[:rows])
        self.a.copy_(a[:rows])
        # one request: its state slot and has-state flag are the only metadata that changes with the request
        self.metadata.prefill_state_indices.copy_(metadata.prefill_state_indices)
        self.metadata.prefill_has_initial_state.copy_(metadata.prefill_has_initial_state)


def static_metadata(metadata):
    """The step's metadata with static copies of the tensors the branch reads. For one request of T tokens (and the
    same padding) the query starts, chunk indices and offsets and the convolution's program map depend on T alone, so
    they are copied once; the state slots and the has-state flags are refilled every step (Inputs.fill)."""
    slots = metadata.prefill_state_indices.clone()
    has_state = metadata.prefill_has_initial_state.clone()
    starts = metadata.prefill_query_start_loc.clone()
    nums_dict = {}
    batch_ptr, offsets_ptr = metadata.batch_ptr, metadata.token_chunk_offset_ptr
    static_ptrs = {}
    for block, entry in metadata.nums_dict.items():
        entry = dict(entry)
        for name in ("batch_ptr", "token_chunk_offset_ptr"):
            tensor = entry.get(name)
            if tensor is not None:
                entry[name] = static_ptrs.setdefault(id(tensor), tensor.clone())
        nums_dict[block] = entry
    return replace(
        metadata,
        has_initial_state=has_state,
        prefill_has_initial_state=has_state,
        non_spec_state_indices_tensor=slots,
        prefill_state_indices=slots,
        non_spec_query_start_loc=starts,
        prefill_query_start_loc=starts,
        chunk_indices=metadata.chunk_indices.clone(),
        chunk_offsets=metadata.chunk_offsets.clone(),
        nums_dict=nums_dict,
        batch_ptr=None if batch_ptr is None else static_ptrs.setdefault(id(batch_ptr), batch_ptr.clone()),
        token_chunk_offset_ptr=None
        if offsets_ptr is None
        else static_ptrs.setdefault(id(offsets_ptr), offsets_ptr.clone()),
    )


def same_layout(tensor):
    """An empty tensor with the strides of `tensor` (a view of vLLM's split projection has gaps between its rows): the
    kernels see the layout they see eagerly, so they compile and compute the same."""
    import torch

    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)


class Graphs:
    """Every layer's prefill graphs in one process: the sightings and graphs of each layer, the static inputs of
    each length, one memory pool. `capture(body) -> replay` is torch's CUDA graph capture (cuda_capture); tests give
    a stand-in."""

    def __init__(self, capture, max_tokens: int = MAX_TOKENS):
        self.capture = capture
        self.max_tokens = max_tokens
        self.enabled = True
        self.inputs: dict[tuple, Inputs] = {}

    def layer_state(self, layer) -> dict:
        state = layer.__dict__.get(_LAYER_STATE)
        if state is None:
            state = layer.__dict__[_LAYER_STATE] = {"seen": {}, "graphs": {}}
        return state

    def run(self, layer, mixed_qkv, b, a, core_attn_out, metadata, batch: tuple[int, int, int], eager) -> str:
        """One request's prefill (batch: one_prefill's) in this layer; says how it ran: 'replayed', 'captured' or
        'eager' (`eager()`, vLLM's own code: a length not seen before, past MAX_TOKENS or MAX_LENGTHS, graphs off)."""
        rows = batch[0]
        state = self.layer_state(layer)
        key = (*batch, tuple(mixed_qkv.shape[1:]), tuple(b.shape[1:]), mixed_qkv.dtype, str(mixed_qkv.device))
        replay = state["graphs"].get(key) if self.enabled else None
        if replay is not None:
            inputs = self.inputs[key]
            inputs.fill(mixed_qkv, b, a, metadata, rows)
            replay()
            core_attn_out[:rows].copy_(inputs.out)
            return "replayed"
        if self.enabled and rows <= self.max_tokens and len(state["graphs"]) < MAX_LENGTHS:
            seen = state["seen"]
            if len(seen) >= MAX_COUNTED:
                seen.clear()
            seen[key] = seen.get(key, 0) + 1
            if seen[key] >= MIN_SIGHTINGS:
                inputs = self.inputs.get(key)
                if inputs is None:
                    inputs = self.inputs[key] = Inputs(
                        mixed_qkv=same_layout(mixed_qkv[:rows]),
                        b=same_layout(b[:rows]),
                        a=same_layout(a[:rows]),
                        out=same_layout(core_attn_out[:rows]),
                        metadata=static_metadata(metadata),
                    )
                inputs.fill(mixed_qkv, b, a, metadata, rows)

                def body():
                    prefill_branch(layer, inputs.mixed_qkv, inputs.b, inputs.a, inputs.out, inputs.metadata, rows)

                try:
                    replay = self.capture(body)
                except Exception as error:  # noqa: BLE001 - any failure: vLLM's own code from now on
                    self.enabled = False
                    self.failure = f"{type(error).__name__}: {error}"
                else:
                    state["graphs"][key] = replay
                    del seen[key]
                    replay()
                    core_attn_out[:rows].copy_(inputs.out)
                    return "captured"
        eager()
        return "eager"


def cuda_capture(pool_for=None):
    """capture(body) for Graphs: body captured on a side stream into one private pool (thread-local capture: vLLM's
    other threads keep working), returned as the graph's replay. No synchronize, gc or empty_cache around it, unlike
    torch.cuda.graph's context manager: this runs in the middle of a forward pass."""
    import torch

    pools, streams = {}, {}

    def capture(body):
        device = torch.cuda.current_device()
        if device not in pools:
            pools[device] = torch.cuda.graph_pool_handle() if pool_for is None else pool_for(device)
            streams[device] = torch.cuda.Stream()
        current, side = torch.cuda.current_stream(), streams[device]
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(pool=pools[device], capture_error_mode="thread_local")
            try:
                body()
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph.replay

    return capture


def patched_forward_core(original, graphs: Graphs, log=None):
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        import torch
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

        raw = gdn.get_forward_context().attn_metadata  # what vLLM's _forward_core reads
        metadata = raw.get(self.prefix) if isinstance(raw, dict) else None
        batch = one_prefill(metadata)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if batch is None or self.gdn_prefill_backend != "triton" or capturing:
            return original(self, mixed_qkv, b, a, core_attn_out)
        enabled = graphs.enabled
        how = graphs.run(
            self,
            mixed_qkv,
            b,
            a,
            core_attn_out,
            metadata,
            batch,
            lambda: original(self, mixed_qkv, b, a, core_attn_out),
        )
        if log is not None:
            if enabled and not graphs.enabled:
                log(f"gdn prefill graphs: capture failed, eager from now on ({graphs.failure})")
            elif how == "captured" and not getattr(_forward_core, "_logged", False):
                _forward_core._logged = True  # the GPU proof reads this line to know graphs were taken
                log(f"gdn prefill graphs: captured a {batch[1]}-token prefill")

    setattr(_forward_core, _WRAPPED, original)
    return _forward_core


@guarded("gdn_prefill_graphs")
def register() -> None:
    from vllm.logger import init_logger
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    cls = gdn.QwenGatedDeltaNetAttention
    if not hasattr(cls._forward_core, _WRAPPED):
        logger = init_logger("vllm.plugins.serving_gdn_prefill_graphs")
        cls._forward_core = patched_forward_core(cls._forward_core, Graphs(cuda_capture()), logger.info)
