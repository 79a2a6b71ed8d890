"""The bake on the serving venv's own torch and vLLM (what the tiny image runs): the in-container bandwidth query,
and vLLM's compile-cache key, which must not depend on HOME (tests/unit/test_bake.py: the bake's pure parts)."""

import json

import pytest

from conftest import ROOT


@pytest.mark.e2e
def test_the_bandwidth_query_runs_with_torch_on_the_cpu(tiny_venvs):
    """The in-container snippet itself, on the serving venv's torch (what the tiny image runs): a positive GB/s."""
    import subprocess

    from lib.containers import BANDWIDTH_QUERY

    command = [str(tiny_venvs["serve-cpu"]), *BANDWIDTH_QUERY[1:]]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["device"] == "cpu" and measured["gbps"] > 0 and measured["buffer_bytes"] == 256 << 20


# vLLM's compile-cache key hashes its environment (vllm.envs.compile_factors); serving.launch.child_env pins the
# paths whose defaults hang off HOME, so the bake (root) and the image (its server user) find the same cache.
COMPILE_FACTORS = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from serving.launch import child_env
os.environ.update(child_env({**os.environ, "HOME": sys.argv[2], "CACHE_DIR": sys.argv[3]}))
import vllm.envs
print(json.dumps({k: str(v) for k, v in vllm.envs.compile_factors().items()}, sort_keys=True))
"""


@pytest.mark.e2e
def test_vllms_compile_cache_key_does_not_depend_on_home(tiny_venvs, tmp_path):
    import subprocess

    keys = []
    for home in ("/root", "/tmp"):
        command = [str(tiny_venvs["serve-cpu"]), "-c", COMPILE_FACTORS, str(ROOT), home, str(tmp_path)]
        out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
        keys.append(json.loads(out.stdout.strip().splitlines()[-1]))
    differing = {
        k: (keys[0].get(k), keys[1].get(k)) for k in set(keys[0]) | set(keys[1]) if keys[0].get(k) != keys[1].get(k)
    }
    assert len(keys[0]) > 50 and not differing, differing
