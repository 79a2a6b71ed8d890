"""The bake's pure parts: the cold-start record, the deterministic cache tar; and reading vLLM's cache verdict on the
built image's start (latency_probe, which fails a variant whose image does not load its baked cache)."""

import io
import tarfile

import pytest

from bake_compile_cache import coldstart_record
from conftest import ROOT
from latency_probe import compile_cache_verdict
from lib.bake_compile_cache.cache_tar import deterministic_tar
from lib.stage import StageError, validate_json
from lib.vllm_logs import cache_evidence

HIT = (
    "(EngineCore pid=88) INFO 11-22 14:02:11 [decorators.py:322] Directly load AOT compilation from path "
    "/opt/ml/cache/vllm/torch_compile_cache/torch_aot_compile/3f2a/rank_0_0/model"
)
MISS = (
    "(EngineCore pid=88) WARNING 11-22 13:40:02 [decorators.py:334] Compiling model again due to a load failure "
    "from /opt/ml/cache/vllm/torch_compile_cache/x/model, reason: 'function' object has no attribute "
    "'finalize_loading'"
)
PACKED = {"files": 12, "bytes": 3456}
CPU = {"name": None, "compute_capability": None, "arch": "cpu"}
H100 = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "arch": "sm_90"}


def test_a_direct_load_is_a_hit():
    evidence = cache_evidence(f"noise\n{HIT}\nmore noise\n")
    assert evidence == {"hits": [HIT[HIT.index("Directly") :]], "misses": []}
    verdict = compile_cache_verdict(f"noise\n{HIT}\nmore noise\n", require_hit=True)
    assert verdict == {"hit": True, "evidence": evidence["hits"], "load_failures": []}


@pytest.mark.parametrize("log", [MISS, f"{HIT}\n{MISS}", "no word about the cache"])
def test_a_reload_failure_or_silence_is_no_hit_and_fails_the_probe_when_a_hit_is_required(log):
    verdict = compile_cache_verdict(log, require_hit=False)
    assert verdict["hit"] is False
    assert bool(verdict["load_failures"]) == ("load failure" in log)
    expected = "Compiling model again" if "load failure" in log else "no Directly load line"
    with pytest.raises(StageError, match=f"did not load the compile cache.*{expected}.*require_cache_hit: false"):
        compile_cache_verdict(log, require_hit=True)


def test_the_coldstart_record_is_schema_valid():
    record = coldstart_record(80.44, 200.0, PACKED, "base", CPU, "pipeline-offline")
    validate_json(record, ROOT / "schemas" / "coldstart.schema.yaml")
    assert record["cold_start_empty_cache_s"] == 80.4 and record["cache_files"] == PACKED["files"]
    with pytest.raises(StageError, match="bake_s"):
        validate_json({k: v for k, v in record.items() if k != "bake_s"}, ROOT / "schemas" / "coldstart.schema.yaml")


def test_the_per_graph_inductor_cache_counts_too():
    line = "Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 1.2 s"
    assert cache_evidence(line)["hits"] == [line]


def test_the_cache_tar_is_the_same_bytes_for_the_same_tree(tmp_path):
    for run in ("a", "b"):
        tree = tmp_path / run / "cache"
        (tree / "vllm" / "x").mkdir(parents=True)
        (tree / "vllm" / "x" / "model").write_bytes(b"compiled")
        (tree / "triton" / "k").mkdir(parents=True)
        (tree / "triton" / "k" / "kernel.so").write_bytes(b"\x7fELF")
        assert deterministic_tar(tree, tmp_path / run / "cache.tar") == {"files": 2, "bytes": 12}
    assert (tmp_path / "a" / "cache.tar").read_bytes() == (tmp_path / "b" / "cache.tar").read_bytes()
    with tarfile.open(fileobj=io.BytesIO((tmp_path / "a" / "cache.tar").read_bytes())) as archive:
        assert {m.mtime for m in archive.getmembers()} == {0}


# ---- the GPU the cache was baked on ---------------------------------------------------------------------------


class FakeContainer:
    """A running container whose `docker exec` answers from a table (command name -> (exit code, output))."""

    def __init__(self, answers):
        self.name, self.answers, self.ran = "bake-1", answers, []

    def exec(self, cmd, timeout_s=60):
        from subprocess import CompletedProcess

        self.ran.append(cmd[0])
        code, out = self.answers.get(cmd[0], (127, f"{cmd[0]}: not found"))
        return CompletedProcess(cmd, code, out if code == 0 else "", "" if code == 0 else out)


def test_the_record_names_the_gpu_and_the_schema_checks_it():
    record = coldstart_record(80.0, 200.0, PACKED, "base", H100, "pipeline-offline")
    assert record["gpu"] == H100
    schema = ROOT / "schemas" / "coldstart.schema.yaml"
    for bad in ({**H100, "arch": "hopper"}, {**H100, "compute_capability": "nine"}):
        with pytest.raises(StageError, match="gpu"):
            validate_json({**record, "gpu": bad}, schema)
    with pytest.raises(StageError, match="gpu"):
        validate_json({k: v for k, v in record.items() if k != "gpu"}, schema)


def test_the_gpu_is_read_in_the_container_nvidia_smi_first_then_torch():
    from lib import containers

    smi = FakeContainer({"nvidia-smi": (0, "NVIDIA A10G, 8.6\n")})
    assert containers.container_gpu(smi, gpus=True) == {
        "name": "NVIDIA A10G",
        "compute_capability": "8.6",
        "arch": "sm_86",
    }
    torch = FakeContainer({"python3": (0, "NVIDIA H100 80GB HBM3, 9.0\n")})
    assert containers.container_gpu(torch, gpus=True)["arch"] == "sm_90" and torch.ran == ["nvidia-smi", "python3"]
    none = FakeContainer({})
    with pytest.raises(StageError, match="bake-1 runs with --gpus all but neither nvidia-smi nor torch"):
        containers.container_gpu(none, gpus=True)
    cpu = FakeContainer({"nvidia-smi": (0, "NVIDIA A10G, 8.6\n")})
    assert containers.container_gpu(cpu, gpus=False) == CPU and cpu.ran == []  # no --gpus: the CPU, nothing asked
    mixed = FakeContainer({"nvidia-smi": (0, "NVIDIA H100, 9.0\nNVIDIA A10G, 8.6\n")})
    with pytest.raises(StageError, match="several architectures \\(sm_86, sm_90"):
        containers.container_gpu(mixed, gpus=True)
    with pytest.raises(StageError, match="cannot read a GPU name"):
        containers.parse_gpu_query("NVIDIA H100, [N/A]")


def test_the_memory_bandwidth_is_measured_in_the_container_or_the_stage_says_why_not():
    from lib import containers

    measured = '{"device": "NVIDIA A10G", "gbps": 512.3, "buffer_bytes": 268435456, "repeats": 50, "threads": 8}'
    good = FakeContainer({"python3": (0, "a warning first\n" + measured + "\n")})
    assert containers.container_bandwidth(good)["gbps"] == 512.3 and good.ran == ["python3"]
    for answer, seen in (
        ((1, "ModuleNotFoundError: No module named 'torch'"), "No module named 'torch'"),
        ((0, "not json"), "gave no result"),
        ((0, '{"device": "cpu", "gbps": 0}'), "gave no result"),
    ):
        with pytest.raises(StageError, match=seen):
            containers.container_bandwidth(FakeContainer({"python3": answer}))
