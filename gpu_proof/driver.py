"""The GPU proof: variants of the pipeline's own catalog (config.yaml's `variants` and `sweeps`), served on a GPU
host without Docker by the image's entrypoint (`python3 -m serving`) and timed by the pipeline's probe.

    python3 gpu_proof/driver.py --variants bf16,awq-w4a16-g32-none,awq-w4a16-g32-mtp2 [--plan]
        [--state /tmp/gp] [--together N] [--warmup 2] [--runs 5] [--random-drafter] [--profile VARIANT]

Steps, each leaving STATE/done/<step> so a relaunch skips it: `environment` (GPU, CPU, versions), `checkpoint` (a
full-size random checkpoint of Qwen3.5-4B's shapes, gpu_proof/build_checkpoint.py), `bandwidth`
(gpu_proof/bandwidth.py), `quantize-<recipe>` (scripts/quantize.py with the job the rule writes,
gpu_proof/quantize_variant.py), `drafter` (with --random-drafter: a random drafter of the real one's shapes for the
dflash variants, gpu_proof/build_checkpoint.py --drafter), `serve-<n>` (a group of variants, see --together) and
`lossless` (each speculative variant's greedy ids against the run's no-speculation variant of the same recipe, by
scripts/lib/lossless.py). One JSON a step goes to STATE/results (re-packed into STATE/results.tar.gz after every
write, so what is done survives a machine taken back); gpu_proof/collect.py turns them into the committed records.

Options beyond the catalog, each recorded in the variant's record under `options`:
  --together N      start N variants at once (each with gpu_memory_utilization 0.88/N), then probe them one at a
                    time on an otherwise idle GPU: a start costs minutes, a lease has thirty
  --random-drafter  dflash variants draft with random weights of the real drafter's shapes (no hub here)
  --profile V       after V's probe, one short request between /start_profile and /stop_profile (vLLM's profiler)
  --checkpoint DIR  serve this checkpoint instead of a random one (the tiny profile's trained checkpoint, made on a
                    CPU by the pipeline's own rules, with --config config/tiny.yaml): acceptance and the lossless check
                    mean something only on trained weights
  --quantized R=DIR a recipe's quantized model made elsewhere (the pipeline's quantize rule): step quantize-R uses it
  --drafter DIR     the dflash variants' drafter made elsewhere (the pipeline's download_draft, for --checkpoint)
  --engine X.Y.Z    the vLLM release the bundle must be (default: the config's engine.vllm); another one is measured
                    only when named here, and the environment record says which ran
  --share-state DIR another driver's state on this host (the same lease): its bandwidth, and unless given here its
                    checkpoint, quantized models and drafter, are waited for and used, not made again, so a second
                    engine is measured on the same weights
  --gpu-share F     the GPU memory share each server asks for (default 0.88 / --together): drivers run side by side
                    must split the GPU between them
  --kv-cache-gib G  each shared server's KV cache (default 8; a tiny model needs far less)
  --serve-set K=V   a serve setting every server of the run takes (V is JSON), e.g. gdn_prefill_backend="triton" for
                    the tiny catalog on a GPU whose bundle lacks FlashInfer's CUTLASS DSL GDN prefill
  --patches off     every vLLM patch off (serve.patches): a vLLM other than the one the patches were tested against
                    refuses them at start, so a new engine is first measured without them
  --restart V,W     after the probe, these variants' servers are stopped and started again on the cache their first
                    start filled (what rule bake_compile_cache ships in the image), and that start is timed beside
                    the first
  --reference-for V=R  the lossless step checks V against R's reference instead of its own recipe's (a canary: a
                    variant known to answer differently must fail the check, or the check has no teeth)
A variant the catalog does not define is refused before any step runs (--plan checks a list without a GPU).
Drivers on one host (another engine, another model) may start servers side by side; what is timed (the bandwidth,
each probe, the floor) runs under one host-wide lock (PROBE_LOCK), so no two timings overlap, and a probe first
waits until no server on the host is starting (STARTING: their compiling loads the CPUs whose host work sets a
step's pace; past QUIET_WAIT_S it probes anyway and its record says host_busy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from lib.containers import free_port, wait_for_ping  # noqa: E402
from lib.decode_bytes import draft_passes, part_bytes, step_bytes, step_total  # noqa: E402
from lib.probe import probe  # noqa: E402

SITE_VLLM = os.environ.get("SITE_VLLM", "/tmp/site-vllm")
SITE_LLMC = os.environ.get("SITE_LLMC", "/tmp/site-llmcompressor")
SITE_EXTRA = os.environ.get("SITE_EXTRA", "/tmp/site-extra")  # jsonschema & co. for quantize's report check
KERNEL_CACHES = ("triton", "inductor", "flashinfer")  # what a later start may reuse; vllm/ (its graphs) it may not
SHARED_GPU_MEMORY = 0.88  # of the GPU, split between the servers started together
# ...each with a KV cache of this size: vLLM sizes it by profiling the memory its own start used, which servers
# starting beside it would inflate (vLLM's --kv-cache-memory-bytes skips that profiling)
SHARED_KV_CACHE_BYTES = 8 * 2**30
PROBE_LOCK = Path(os.environ.get("PROBE_LOCK", "/tmp/gpu-proof-probe.lock"))
# one file a server starting on the host (any driver's): a probe waits, under PROBE_LOCK, until none is left, since
# their compiling loads the CPUs whose host work sets a step's pace; after QUIET_WAIT_S it probes anyway and the
# record says host_busy
STARTING = Path(os.environ.get("PROBE_STARTING", "/tmp/gpu-proof-starting"))
QUIET_WAIT_S = 900
SHARED_WAIT_S = 3600  # how long a step waits for the shared state's driver to finish it
PROFILER = {"profiler": "torch", "torch_profiler_with_stack": False, "torch_profiler_record_shapes": False}


class PlanError(SystemExit):
    """A run that cannot be planned (unknown variant, a drafter with no way to get it): before any step."""


def catalog(config_path: Path):
    """The pipeline's view of a config (lib.config.load: schema defaults filled, sweeps expanded)."""
    import yaml

    from lib import config as pipeline_config

    return pipeline_config.load(yaml.safe_load(config_path.read_text()), ROOT)


def quantizes(recipe: str) -> bool:
    """Whether scripts/quantize.py changes the weights for this recipe (bf16's recipe has no *_stage: a copy)."""
    import yaml

    return any(key.endswith("_stage") for key in yaml.safe_load((ROOT / recipe).read_text()))


def plan(names: list[str], variants: dict, together: int, random_drafter: bool) -> list[str]:
    """The steps that serve `names` (catalog variants) in their order, `together` a group; each recipe is quantized
    and the drafter made just before the first group that needs them, so the first group serves sooner."""
    unknown = [name for name in names if name not in variants]
    if unknown:
        raise PlanError(f"not in the catalog (config variants and sweeps): {unknown}; known: {sorted(variants)}")
    if not names:
        raise PlanError("no variants given (--variants a,b,c)")
    drafted = [name for name in names if variants[name]["speculative"]["method"] == "dflash"]
    if drafted and not random_drafter:
        raise PlanError(
            f"{drafted} draft with a trained drafter, which this offline host cannot fetch: --random-drafter"
        )
    steps = ["environment", "checkpoint", "bandwidth"]
    for start in range(0, len(names), together):
        for name in names[start : start + together]:
            recipe = variants[name]["recipe"]
            if quantizes(recipe) and f"quantize-{Path(recipe).stem}" not in steps:
                steps.append(f"quantize-{Path(recipe).stem}")
            if name in drafted and "drafter" not in steps:
                steps.append("drafter")
        steps.append(f"serve-{start // together + 1}")
    if any(variants[name]["speculative"]["method"] != "none" for name in names):
        steps.append("lossless")
    return steps


def starting_on_host() -> list[str]:
    """The servers starting on this host, by their markers (`<driver pid>-<state>-<variant>`); a dead driver's
    markers are dropped."""
    alive = []
    for marker in sorted(STARTING.glob("*")) if STARTING.is_dir() else []:
        try:
            os.kill(int(marker.name.split("-", 1)[0]), 0)
        except (ValueError, ProcessLookupError):
            marker.unlink(missing_ok=True)
            continue
        except PermissionError:
            pass  # alive, another user's
        alive.append(marker.name)
    return alive


class Driver:
    def __init__(self, state: Path, names: list[str], pipeline, options: dict):
        self.state, self.names, self.pipeline = state, names, pipeline
        self.variants = pipeline.config["variants"]
        self.options = {"together": 1, "random_drafter": False, "profile": None, "warmup": 2, "runs": 5, **options}
        self.results, self.done = state / "results", state / "done"
        for folder in (self.results / "logs", self.done, state / "serve", state / "cache", state / "quant"):
            folder.mkdir(parents=True, exist_ok=True)
        given, shared = self.options.get("checkpoint"), self.options.get("share_state")
        made_in = Path(shared) if shared else state  # where the checkpoint, quantized models and drafter are made
        self.made_in = made_in
        self.model_dir = Path(given) if given else made_in / "weights" / "Qwen3.5-4B-random"
        self.quantized = {key: Path(value) for key, value in (self.options.get("quantized") or {}).items()}
        self.drafter_dir = Path(self.options.get("drafter") or made_in / "weights" / "drafter-random")
        self.serve_env = dict(self.options.get("serve_env") or {})
        self.serve_cmd = [sys.executable, "-m", "serving"]  # the image's entrypoint (tests swap in fake_server.py)

    # ---- bookkeeping ----
    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    def record(self, name: str, data: dict) -> None:
        path = self.results / f"{name}.json"
        path.with_name(path.name + ".partial").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        path.with_name(path.name + ".partial").replace(path)
        with tarfile.open(self.state / "results.tar.gz.partial", "w:gz") as archive:
            archive.add(self.results, arcname="results")
        (self.state / "results.tar.gz.partial").replace(self.state / "results.tar.gz")

    def groups(self) -> dict[str, list[str]]:
        together = self.options["together"]
        return {f"serve-{i // together + 1}": self.names[i : i + together] for i in range(0, len(self.names), together)}

    def run(self) -> None:
        drafted = self.options["random_drafter"] or bool(self.options.get("drafter"))
        steps = plan(self.names, self.variants, self.options["together"], drafted)
        for step in steps:
            if (self.done / step).exists():
                self.log(f"{step}: done before, skipped")
                continue
            self.log(f"=== {step}")
            started = time.monotonic()
            try:
                kind, _, arg = step.partition("-")
                if self.shares(kind, arg):
                    self.take_shared(step)
                else:
                    getattr(self, f"step_{kind}")(arg)
                (self.done / step).write_text(f"{time.monotonic() - started:.1f}\n")
                self.log(f"{step}: ok in {time.monotonic() - started:.0f} s")
            except Exception as error:  # noqa: BLE001  recorded; later steps go on where they can
                self.log(f"{step}: FAILED after {time.monotonic() - started:.0f} s: {error}")
                traceback.print_exc()
                failure = {"step": step, "error": str(error)[-4000:], "seconds": time.monotonic() - started}
                self.record(f"failed-{step}", {"kind": "failure", "status": "failed", **failure})
        self.log("all steps finished")

    # ---- a state shared with another driver on this host ----
    def shares(self, kind: str, arg: str) -> bool:
        """Whether this step is taken from --share-state instead of run here."""
        if not self.options.get("share_state"):
            return False
        given = {
            "checkpoint": bool(self.options.get("checkpoint")),
            "quantize": arg in self.quantized,
            "drafter": bool(self.options.get("drafter")),
            "bandwidth": False,
        }
        return kind in given and not given[kind]

    def take_shared(self, step: str) -> None:
        """Wait for the other driver's step, then use what it made (its record is copied; its folders are read)."""
        shared = Path(self.options["share_state"])
        deadline = time.monotonic() + SHARED_WAIT_S
        while not (shared / "done" / step).exists():
            if (shared / "results" / f"failed-{step}.json").exists() or time.monotonic() > deadline:
                raise RuntimeError(f"{shared}: step {step} failed or did not finish")
            time.sleep(5)
        record = shared / "results" / f"{step}.json"  # each of these steps records under its own name
        if record.exists():
            self.record(step, json.loads(record.read_text()) | {"shared_from": str(shared)})

    def probe_lock(self):
        """The host-wide lock every timing runs under (fcntl: released when the process dies)."""
        import fcntl

        handle = open(PROBE_LOCK, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        return handle

    def mark_starting(self, name: str, starting: bool) -> None:
        marker = STARTING / f"{os.getpid()}-{self.state.name}-{name}"
        if starting:
            STARTING.mkdir(parents=True, exist_ok=True)
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    def wait_quiet(self) -> bool:
        """Until no server on the host is starting (held under the probe lock, so no timing runs meanwhile); False
        where QUIET_WAIT_S ran out first."""
        deadline = time.monotonic() + QUIET_WAIT_S
        while busy := starting_on_host():
            if time.monotonic() > deadline:
                self.log(f"{len(busy)} servers still starting after {QUIET_WAIT_S} s: probed anyway (host_busy)")
                return False
            time.sleep(min(5.0, QUIET_WAIT_S / 10))
        return True

    # ---- steps ----
    def step_environment(self, _: str) -> None:
        query = "--query-gpu=name,driver_version,memory.total"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
        name, driver, memory = [part.strip() for part in smi.stdout.splitlines()[0].split(",")]
        versions = {}
        for label, site, packages in (
            ("host", "", ["torch", "transformers", "triton"]),
            ("vllm_bundle", SITE_VLLM, ["vllm", "flashinfer-python", "compressed-tensors", "torch", "transformers"]),
            ("llmcompressor_bundle", SITE_LLMC, ["llmcompressor", "compressed-tensors"]),
        ):
            code = (
                "import json, importlib.metadata as m\nout = {}\nfor n in %r:\n    try: out[n] = m.version(n)\n"
                "    except m.PackageNotFoundError: out[n] = 'absent'\nprint(json.dumps(out))" % packages
            )
            env = dict(os.environ, PYTHONPATH=site)
            found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            versions[label] = json.loads(found.stdout)
        bundled, expected = versions["vllm_bundle"]["vllm"], self.options.get("engine")
        if expected and bundled.split("+", 1)[0] != expected:
            raise RuntimeError(f"the vLLM bundle at {SITE_VLLM} is {bundled}, not {expected} (--engine, engine.vllm)")
        cpuinfo = Path("/proc/cpuinfo").read_text()
        models = {line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")}
        environment = {"gpu": {"name": name, "driver": driver, "memory_total": memory}, "versions": versions}
        environment.update(cpu=" / ".join(sorted(models)) or None, cpu_count=os.cpu_count(), date=time.strftime("%F"))
        self.record("environment", {"kind": "environment", "status": "ok", **environment})

    def step_checkpoint(self, _: str) -> None:
        if self.options.get("checkpoint"):
            self.record("checkpoint", describe_checkpoint(self.model_dir))
            return
        shutil.rmtree(self.model_dir, ignore_errors=True)
        self._python([str(ROOT / "gpu_proof" / "build_checkpoint.py"), str(self.model_dir), str(self.state / "c.json")])
        self.record("checkpoint", json.loads((self.state / "c.json").read_text()))

    def step_bandwidth(self, _: str) -> None:
        with self.probe_lock():
            self._python([str(ROOT / "gpu_proof" / "bandwidth.py"), str(self.state / "b.json")])
        self.record("bandwidth", json.loads((self.state / "b.json").read_text()))

    def step_drafter(self, _: str) -> None:
        if self.options.get("drafter"):
            files = sorted(self.drafter_dir.glob("*.safetensors"))
            record = {"kind": "drafter", "status": "ok", "given": str(self.drafter_dir)}
            self.record("drafter", record | {"total_bytes": sum(f.stat().st_size for f in files)})
            return
        shutil.rmtree(self.drafter_dir, ignore_errors=True)
        args = [str(ROOT / "gpu_proof" / "build_checkpoint.py"), "--drafter", str(self.drafter_dir)]
        self._python([*args, str(self.state / "d.json"), "--target", str(self.model_dir)])
        self.record("drafter", json.loads((self.state / "d.json").read_text()))

    def step_quantize(self, recipe_key: str) -> None:
        recipe = self.pipeline.recipes[recipe_key]
        if recipe_key in self.quantized:
            model = self.quantized[recipe_key]
            if not (model / "config.json").is_file():
                raise RuntimeError(f"--quantized {recipe_key}={model}: no config.json there")
            self.record(f"quantize-{recipe_key}", {"kind": "quantize", "status": "ok", "given": str(model)})
            return
        out = self.state / "quant" / recipe_key
        shutil.rmtree(out, ignore_errors=True)
        result = self.state / f"quantize-{recipe_key}.json"
        env = {"PYTHONPATH": os.pathsep.join([SITE_LLMC, SITE_EXTRA]), "TOKENIZERS_PARALLELISM": "false"}
        args = [str(ROOT / "gpu_proof" / "quantize_variant.py"), str(self.model_dir), str(ROOT / recipe), str(out)]
        try:
            self._python([*args, str(result)], env=env, timeout=1800)
        finally:
            if result.exists():
                self.record(f"quantize-{recipe_key}", json.loads(result.read_text()))

    def step_lossless(self, _: str) -> None:
        """Each probed speculative variant against the run's no-speculation variant of its recipe (whose server
        also ran the reference requests: first runs with top logprobs, as rule lossless_reference records)."""
        from lib.lossless import compare, failures

        records = {name: self._read(f"variant-{name}") for name in self.names}
        references = {r["recipe"]: r for r in records.values() if r and r.get("reference")}
        checks = []
        for name, record in records.items():
            if not record or record["speculative"]["method"] == "none" or not record.get("probe"):
                continue
            canary = (self.options.get("reference_for") or {}).get(name)
            reference = (records.get(canary) or {}) if canary else references.get(record["recipe"])
            reference = reference if reference and reference.get("reference") else None
            if reference is None:
                checks.append({"variant": name, "reference_variant": None, "passed": False, "rows": []})
                recipe = record["recipe"]
                missing = f"reference of {canary} (--reference-for)" if canary else f"variant of recipe {recipe}"
                checks[-1]["failures"] = [f"no {missing} without speculation in this run"]
                continue
            rows = compare(record["probe"], reference["reference"])
            check = {"variant": name, "reference_variant": reference["variant"], "rows": rows}
            if canary:
                check["canary"] = "checked against another variant's reference: it must fail"
            checks.append({**check, "passed": not failures(rows), "failures": failures(rows)})
        self.record("lossless", {"kind": "lossless", "status": "ok", "checks": checks})

    def step_serve(self, group: str) -> None:
        """Start the group's servers together, probe them one at a time on an otherwise idle GPU, stop them. A
        variant that fails is recorded as failed and the others go on; one probed before (a relaunch) is skipped."""
        names = [n for n in self.groups()[f"serve-{group}"] if (self._read(f"variant-{n}") or {}).get("status") != "ok"]
        running, failed = {}, []
        try:
            for name in names:
                try:
                    running[name] = self.start(name, len(names))
                except Exception as error:  # noqa: BLE001  (a missing checkpoint: the others still serve)
                    failed.append(self.fail(name, None, error))
            for name, (proc, base, log_path, record, started) in list(running.items()):
                try:
                    wait_for_ping(base, 1200, alive=lambda p=proc: p.poll() is None, logs=lambda p=log_path: tail(p))
                except Exception as error:  # noqa: BLE001
                    failed.append(self.fail(name, record, error))
                    self.stop(running.pop(name)[0])
                    continue
                finally:
                    self.mark_starting(name, False)
                record["cold_start"]["seconds"] = round(time.monotonic() - started, 1)  # from its own start
                self.log(f"{name}: ready after {record['cold_start']['seconds']:.0f} s")
                self.record(f"variant-{name}", record)
            for name, (_, base, _, record, _) in running.items():
                try:
                    with self.probe_lock():
                        if not self.wait_quiet():
                            record["host_busy"] = True
                        self.probe_variant(name, base, record)
                except Exception as error:  # noqa: BLE001
                    failed.append(self.fail(name, record, error))
            if self.options.get("restart"):
                for name in [n for n in running if n not in failed and n in self.options["restart"]]:
                    self.stop(running[name][0])
                    try:
                        running[name] = self.restart(name, running[name], len(names))
                    except Exception as error:  # noqa: BLE001
                        failed.append(self.fail(name, running[name][3], error))
        finally:
            for proc, *_ in running.values():
                self.stop(proc)
            for name in names:
                self.mark_starting(name, False)
        first = next((self.state / "cache" / n for n in running if n not in failed), None)
        if first is not None and not (self.state / "cache" / "kernels.tar").exists():
            with tarfile.open(self.state / "cache" / "kernels.tar", "w") as archive:
                for sub in KERNEL_CACHES:
                    if (first / sub).is_dir():
                        archive.add(first / sub, arcname=sub)
        if failed:
            raise RuntimeError(f"failed: {failed} (their records say why)")

    def fail(self, name: str, record: dict | None, error: Exception) -> str:
        self.log(f"{name}: FAILED: {error}")
        record = record or {"kind": "variant", "variant": name}
        self.record(f"variant-{name}", {**record, "status": "failed", "error": str(error)[-4000:]})
        return name

    # ---- serving ----
    def model_for(self, name: str) -> Path:
        recipe = self.variants[name]["recipe"]
        if not quantizes(recipe):
            return self.model_dir
        model = self.quantized.get(Path(recipe).stem) or self.made_in / "quant" / Path(recipe).stem / "model"
        if not (model / "config.json").is_file():
            raise RuntimeError(f"{model} is missing: quantize-{Path(recipe).stem} did not finish")
        return model

    def serve_settings(self, name: str, together: int) -> tuple[dict, dict]:
        """serve.json exactly as rule serve_config writes it, and what this run changed (`options`)."""
        settings = self.pipeline.serve_json(name)
        options = {}
        if together > 1 or self.options.get("gpu_share"):
            share = self.options.get("gpu_share") or SHARED_GPU_MEMORY / together
            share = round(min(settings["gpu_memory_utilization"] or 0.9, share), 3)
            options["gpu_memory_utilization"] = settings["gpu_memory_utilization"] = share
            kv_bytes = int(self.options.get("kv_cache_gib") or SHARED_KV_CACHE_BYTES / 2**30) * 2**30
            options["kv_cache_memory_bytes"] = kv_bytes
            settings["extra_args"] = [*settings["extra_args"], "--kv-cache-memory-bytes", str(kv_bytes)]
        for key, value in (self.options.get("serve_set") or {}).items():
            settings[key] = options.setdefault("serve_set", {})[key] = value
        if self.options.get("patches") == "off":
            settings["patches"] = {patch: False for patch in settings["patches"]}
            options["patches"] = "off"
        if settings["speculative"]["method"] == "dflash" and not self.options.get("drafter"):
            options["drafter"] = "random weights of the real drafter's shapes"
        if self.options["profile"] == name:
            profiler = dict(PROFILER, torch_profiler_dir=str(self.state / "profile" / name))
            settings["extra_args"] = [*settings["extra_args"], "--profiler-config", json.dumps(profiler)]
            options["profile"] = "one short request under vLLM's torch profiler, after the probe"
        return settings, options

    def start(self, name: str, together: int, restart: bool = False):
        """A server of `name` on a cache of its own, seeded with an earlier group's kernel caches; a restart starts
        on the cache its first start left, logs apart, and leaves the probed record on disk as it is."""
        from serving.launch import CACHE_DIRS

        model = self.model_for(name)
        settings, options = self.serve_settings(name, together)
        serve_json = self.state / "serve" / f"{name}.json"
        serve_json.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        cache = self.state / "cache" / name
        if not restart:
            shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        seeded = (self.state / "cache" / "kernels.tar").exists() and not restart
        if seeded:
            with tarfile.open(self.state / "cache" / "kernels.tar") as archive:
                archive.extractall(cache, filter="fully_trusted")
        port = free_port()
        env = dict(
            os.environ,
            SERVE_CONFIG=str(serve_json),
            MODEL_DIR=str(model),
            DRAFT_DIR=str(self.drafter_dir),
            HOST="127.0.0.1",
            PORT=str(port),
            CACHE_DIR=str(cache),
            PYTHONPATH=SITE_VLLM,
            VLLM_NO_USAGE_STATS="1",
            PYTHONUNBUFFERED="1",
            **self.serve_env,
        )
        for key in CACHE_DIRS:
            env.pop(key, None)  # serving/launch.py derives them from CACHE_DIR
        log_path = self.results / "logs" / f"{name}{'-restart' if restart else ''}.log"
        with open(log_path, "w") as handle:
            self.log(f"{name}: starting `python3 -m serving` on port {port}")
            self.mark_starting(name, True)
            proc = subprocess.Popen(
                self.serve_cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
        variant = self.variants[name]
        record = {
            "kind": "variant",
            "status": "running",
            "variant": name,
            "config": self.options.get("config", "config.yaml"),
            "recipe": variant["recipe"],
            "speculative": variant["speculative"],
            "serve": settings,
            "options": options,
            "serve_env": self.serve_env,
            "cold_start": {"cache": "seeded" if seeded else "empty", "together": together},
            "weights": part_bytes(model),
            "drafter_bytes": sum(p.stat().st_size for p in self.drafter_dir.glob("*.safetensors"))
            if variant["speculative"]["method"] == "dflash"
            else 0,
        }
        if not restart:
            self.record(f"variant-{name}", record)
        return proc, f"http://127.0.0.1:{port}", log_path, record, time.monotonic()

    def restart(self, name: str, first, together: int):
        """`name` started again on the cache its first start filled (the bake's cache), timed to its first answer."""
        _, _, log_path, record, _ = first
        first_log = log_path.read_text(errors="replace")
        proc, base, log_path, _, started = self.start(name, together, restart=True)
        try:
            wait_for_ping(base, 1200, alive=lambda: proc.poll() is None, logs=lambda: tail(log_path))
        finally:
            self.mark_starting(name, False)
        record["warm_start"] = {
            "cache": "the first start's (what bake_compile_cache ships)",
            "together": together,
            "seconds": round(time.monotonic() - started, 1),
            "compile_log": compile_lines(log_path.read_text(errors="replace")),
        }
        record["cold_start"]["compile_log"] = compile_lines(first_log)
        self.log(f"{name}: restarted on its own cache, ready after {record['warm_start']['seconds']:.0f} s")
        self.record(f"variant-{name}", record)
        return proc, base, log_path, record, started

    def probe_settings(self) -> dict:
        config = self.pipeline.config
        return {**config["probe"], "warmup": self.options["warmup"], "runs": self.options["runs"]}

    def probe_variant(self, name: str, base: str, record: dict) -> None:
        settings = self.probe_settings()
        model_name = record["serve"]["served_model_name"]
        varied = str(ROOT / settings["varied_text"])
        started = time.monotonic()
        record["probe"] = probe(base, model_name, settings, varied, log=self.log)
        record["probe"].update(warmup=settings["warmup"], runs=settings["runs"])
        record["probe_s"] = round(time.monotonic() - started, 1)
        record["decode"] = self.decode_analysis(record)
        self.record(f"variant-{name}", record)
        speculative = [n for n in self.names if self.variants[n]["speculative"]["method"] != "none"]
        canary_references = set((self.options.get("reference_for") or {}).values())
        if name in canary_references or (
            record["speculative"]["method"] == "none"
            and any(self.variants[n]["recipe"] == record["recipe"] for n in speculative)
        ):  # the lossless reference: first runs with their top logprobs, on this same server
            record["reference"] = probe(base, model_name, dict(settings, first_run_only=True), varied, self.log)
        if self.options["profile"] == name:
            self.profile(base, model_name, settings, record)
        record["status"] = "ok"
        self.record(f"variant-{name}", record)

    def profile(self, base: str, model_name: str, settings: dict, record: dict) -> None:
        from lib.openai_client import request
        from lib.probe import probe_set

        short = next(c for c in settings["categories"] if c["name"] == "short")
        one = dict(settings, warmup=0, runs=1, categories=[short])
        request(base, "/start_profile", {}, timeout_s=120)
        result = probe_set(base, model_name, one, [settings["sentence"]], self.log)
        request(base, "/stop_profile", {}, timeout_s=600)
        traces = sorted((self.state / "profile" / record["variant"]).rglob("*.json*"))
        record["profile"] = {"request": result["categories"][0]["median_ms"], "traces": [str(p) for p in traces]}

    def decode_analysis(self, record: dict) -> dict | None:
        bandwidth, checkpoint = self._read("bandwidth"), self._read("checkpoint")
        if not bandwidth or not checkpoint:
            return None
        passes = draft_passes(record["speculative"])
        step_weights = step_total(step_bytes(record["weights"], passes), passes, record["drafter_bytes"])
        return decode_bound(
            step_weights, bandwidth["copy_gbps"], checkpoint["text_config"], record["probe"]["categories"]
        )

    def stop(self, proc) -> None:
        for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue

    def _read(self, name: str) -> dict | None:
        path = self.results / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def _python(self, args: list[str], env: dict | None = None, timeout: float | None = None) -> None:
        log_path = self.results / "logs" / f"{Path(args[0]).stem}-{len(list(self.done.iterdir()))}.log"
        with open(log_path, "w") as handle:
            done = subprocess.run(
                [sys.executable, "-u", *args],
                cwd=ROOT,
                env=dict(os.environ, **(env or {})),
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        if done.returncode != 0:
            raise RuntimeError(f"{Path(args[0]).name} exited {done.returncode}:\n{tail(log_path)}")


# ---- pure helpers (tested without a GPU) ----


def expected_engine(pipeline, given: str | None) -> str:
    """The vLLM release a run serves with: --engine where given, else the config's engine.vllm."""
    return given or pipeline.config["engine"]["vllm"]


def describe_checkpoint(path: Path) -> dict:
    """A given checkpoint's record: its text config in the terms decode_bound reads, and each file's sha256."""
    import hashlib

    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    layer_types = text["layer_types"]
    keys = ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "linear_num_value_heads")
    keys += ("linear_key_head_dim", "linear_value_head_dim", "vocab_size", "tie_word_embeddings")
    files = sorted(path.glob("*.safetensors"))
    return {
        "kind": "checkpoint",
        "status": "ok",
        "path": str(path),
        "builder": "given (--checkpoint)",
        "architecture": config["architectures"][0],
        "text_config": {key: text[key] for key in keys if key in text}
        | {
            "full_attention_layers": layer_types.count("full_attention"),
            "linear_attention_layers": layer_types.count("linear_attention"),
        },
        "weights_sha256": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
        "total_bytes": sum(f.stat().st_size for f in files),
    }


COMPILE_LOG_MARKS = ("torch.compile took", "Directly load", "Compiling a graph", "compile range", "Cache the graph")


def compile_lines(log: str, keep: int = 6) -> list[str]:
    """The lines of a server's log that say whether vLLM compiled or loaded its graphs (the last `keep`)."""
    found = [line.strip()[-240:] for line in log.splitlines() if any(mark in line for mark in COMPILE_LOG_MARKS)]
    return found[-keep:]


def tail(log_path: Path, lines: int = 30) -> str:
    text = Path(log_path).read_text(errors="replace").splitlines() if Path(log_path).exists() else []
    return "\n".join(text[-lines:])


def decode_bound(step_weights: int, copy_gbps: float, text: dict, categories: list[dict]) -> dict:
    """Each category's time a token against the memory-bandwidth bound: a step reads `step_weights` (decoder and
    head, plus MTP's k draft passes or a drafter model's one pass with the head), the full-attention KV cache at the
    category's mean context and the gated DeltaNet state (fp32, read and written); divided by the tokens a step
    yields."""
    kv_per_token = text["full_attention_layers"] * 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    state = 2 * 4 * text["linear_attention_layers"] * text["linear_num_value_heads"]
    state *= text["linear_key_head_dim"] * text["linear_value_head_dim"]
    rows = []
    for category in categories:
        context = category["prompt_tokens"] + category["output_tokens_requested"] / 2
        accepted = category.get("mean_acceptance_length") or 1.0
        total_ms = (step_weights + kv_per_token * context + state) / (copy_gbps * 1e9) * 1e3 / accepted
        itl = category["itl_median_ms"]
        rows.append(
            {
                "category": category["name"],
                "itl_median_ms": round(itl, 3),
                "tokens_per_step": round(accepted, 4),
                "weights_bound_ms": round(step_weights / (copy_gbps * 1e9) * 1e3 / accepted, 3),
                "bound_with_kv_state_ms": round(total_ms, 3),
                "fraction_of_bound": round(total_ms / itl, 3) if itl else None,
            }
        )
    return {"bandwidth_gbps": copy_gbps, "weights_bytes_per_step": step_weights, "categories": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", required=True, help="catalog variants, comma-separated, in the order to run")
    parser.add_argument("--config", default=str(ROOT / "config.yaml"))
    parser.add_argument("--state", default="/tmp/gp")
    parser.add_argument("--together", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--random-drafter", action="store_true")
    parser.add_argument("--profile", default=None, metavar="VARIANT")
    parser.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--checkpoint", default=None, metavar="DIR")
    parser.add_argument("--quantized", action="append", default=[], metavar="RECIPE=DIR")
    parser.add_argument("--patches", choices=("catalog", "off"), default="catalog")
    parser.add_argument("--engine", default=None, metavar="X.Y.Z")
    parser.add_argument("--drafter", default=None, metavar="DIR")
    parser.add_argument("--share-state", default=None, metavar="DIR")
    parser.add_argument("--gpu-share", type=float, default=None, metavar="F")
    parser.add_argument("--kv-cache-gib", type=int, default=None, metavar="G")
    parser.add_argument("--serve-set", action="append", default=[], metavar="KEY=JSON")
    parser.add_argument("--restart", default="", metavar="VARIANT,VARIANT")
    parser.add_argument("--reference-for", action="append", default=[], metavar="VARIANT=REFERENCE")
    parser.add_argument("--plan", action="store_true", help="print the steps and exit (no GPU needed)")
    args = parser.parse_args(argv)
    names = [name for name in args.variants.split(",") if name]
    pipeline = catalog(Path(args.config))
    steps = plan(names, pipeline.config["variants"], args.together, args.random_drafter or bool(args.drafter))
    if args.profile and args.profile not in names:
        raise PlanError(f"--profile {args.profile}: not among --variants {names}")
    quantized = dict(item.split("=", 1) for item in args.quantized)
    unknown = sorted(set(quantized) - set(pipeline.recipes))
    if unknown:
        raise PlanError(f"--quantized {unknown}: not a recipe of the catalog; known: {sorted(pipeline.recipes)}")
    reference_for = dict(item.split("=", 1) for item in args.reference_for)
    restart = [name for name in args.restart.split(",") if name]
    strays = sorted({*reference_for, *reference_for.values(), *restart} - set(names))
    if strays:
        raise PlanError(f"--reference-for or --restart {strays}: not among --variants {names}")
    if args.plan:
        print("\n".join(steps))
        return
    options = {key: getattr(args, key) for key in ("together", "random_drafter", "profile", "warmup", "runs")}
    options["serve_env"] = dict(item.split("=", 1) for item in args.serve_env)
    options["quantized"] = quantized
    options["serve_set"] = {key: json.loads(value) for key, value in (i.split("=", 1) for i in args.serve_set)}
    options["config"] = str(Path(args.config).resolve().relative_to(ROOT))
    options.update(share_state=args.share_state, gpu_share=args.gpu_share, kv_cache_gib=args.kv_cache_gib)
    options.update(restart=restart, reference_for=reference_for)
    options.update(
        checkpoint=args.checkpoint,
        drafter=args.drafter,
        patches=args.patches,
        engine=expected_engine(pipeline, args.engine),
    )
    Driver(Path(args.state), names, pipeline, options).run()


if __name__ == "__main__":
    main()
