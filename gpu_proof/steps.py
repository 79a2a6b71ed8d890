"""The GPU proof's steps on the host, in plan order (gpu_proof/plan.py): each leaves STATE/done/<step> so a relaunch
skips it, and records one JSON (gpu_proof/records.py); a failed step is recorded and the steps after it go on where
they can. The servers are the image's entrypoint (`python3 -m serving`) on the vLLM bundle at SITE_VLLM."""

from __future__ import annotations

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

import plan  # first: it puts scripts/ (lib) on sys.path
import records
from lib.containers import BANDWIDTH_QUERY, free_port, wait_for_ping
from lib.decode_bytes import part_bytes
from lib.probe import probe
from records import compile_lines, host_lock, mark, on_host, tail

ROOT = plan.ROOT
SITE_VLLM = os.environ.get("SITE_VLLM", "/tmp/site-vllm")
SITE_LLMC = os.environ.get("SITE_LLMC", "/tmp/site-llmcompressor")
SITE_EXTRA = os.environ.get("SITE_EXTRA", "/tmp/site-extra")  # jsonschema & co. for quantize's report check
KERNEL_CACHES = ("triton", "inductor", "flashinfer")  # what a later start may reuse; vllm/ (its graphs) it may not
SHARED_GPU_MEMORY = 0.88  # of the GPU, split between the servers started together
# ...each with a KV cache of this size: vLLM sizes it by profiling the memory its own start used, which servers
# starting beside it would inflate (vLLM's --kv-cache-memory-bytes skips that profiling)
SHARED_KV_CACHE_BYTES = 8 * 2**30
QUIET_WAIT_S = 900  # how long a probe waits for the host's starting servers; then it probes anyway (host_busy)
SHARED_WAIT_S = 3600  # how long a step waits for the shared state's driver to finish it


# the packages each bundle holds (the environment step); PYTHONPATH for each is the bundle's folder
BUNDLES = {
    "host": ("", ["torch", "transformers", "triton"]),
    "vllm_bundle": (SITE_VLLM, ["vllm", "flashinfer-python", "compressed-tensors", "torch", "transformers"]),
    "llmcompressor_bundle": (SITE_LLMC, ["llmcompressor", "compressed-tensors"]),
}
VERSIONS = "import importlib.metadata as m, json, sys\ndef v(n):\n try: return m.version(n)\n"
VERSIONS += " except m.PackageNotFoundError: return 'absent'\nprint(json.dumps({n: v(n) for n in sys.argv[1:]}))"


def quantize_job(model_dir: Path, recipe: str, out: Path) -> dict:
    """The job rule quantize gives scripts/quantize.py, for this offline host: calibration on the repository's own
    text (data/tiny/corpus.txt as chat turns, 32 samples as the tiny profile: AWQ grid-searches every layer over every
    sample, and a lease has minutes), and the held-out bounds opened up (on random weights the real profile's 0.9 and
    1.1 say nothing; the measured agreement and perplexity ratio are recorded as they are)."""
    from lib.dag.schema import section_defaults
    from lib.stage import write_manifest

    corpus = str(ROOT / "data" / "tiny" / "corpus.txt")
    calibration = section_defaults("calibration") | {"source": "text_file", "path": corpus, "num_samples": 32}
    calibration |= {"max_seq_length": 512, "seed": 42, "chat": True}
    bounds = section_defaults("quantize") | {"min_top1_agreement": 0.0, "max_ppl_ratio": 1.0e6}
    bounds.pop("heldout", None)  # the rule passes it as an input
    manifest = out / "source-manifest.json"
    write_manifest(model_dir, manifest)  # download's, which quantize checks the checkpoint against
    inputs = {"model": str(model_dir), "model_manifest": str(manifest), "recipe": str(ROOT / recipe)}
    inputs |= {"calibration": corpus, "heldout": str(ROOT / "data" / "heldout.txt"), "keep_texts": []}
    inputs["schema"] = str(ROOT / "schemas" / "quantize_report.schema.yaml")
    outputs = {name: str(out / file) for name, file in (("model", "model"), ("manifest", "manifest.json"))}
    return {
        "rule": "quantize",
        "threads": 16,
        "log": [],
        "wildcards": {"recipe": Path(recipe).stem},
        "input": inputs,
        "output": outputs | {"report": str(out / "report.json")},
        "params": {"calibration": calibration, "quantize": bounds, "keep_sentence": None},
    }


class Driver:
    def __init__(self, state: Path, names: list[str], pipeline, options: dict):
        self.state, self.names, self.pipeline = state, names, pipeline
        self.variants = pipeline.config["variants"]
        defaults = {"together": 1, "max_resident": plan.MAX_RESIDENT, "random_drafter": False, "warmup": 2, "runs": 5}
        self.options = defaults | options
        self.results, self.done = state / "results", state / "done"
        for folder in (self.results / "logs", self.done, state / "serve", state / "cache", state / "quant"):
            folder.mkdir(parents=True, exist_ok=True)
        # where the checkpoint, quantized models and drafter are made: here, or by the driver whose state is shared
        self.made_in = Path(self.options.get("share_state") or state)
        self.model_dir = Path(self.options.get("checkpoint") or self.made_in / "weights" / "Qwen3.5-4B-random")
        self.quantized = {key: Path(value) for key, value in (self.options.get("quantized") or {}).items()}
        self.drafter_dir = Path(self.options.get("drafter") or self.made_in / "weights" / "drafter-random")
        self.serve_env = dict(self.options.get("serve_env") or {})
        self.serve_cmd = [sys.executable, "-m", "serving"]  # the image's entrypoint (tests: serving_standin.py)

    # ---- bookkeeping ----
    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    def record(self, name: str, data: dict) -> None:
        records.write(self.state, name, data)

    def read(self, name: str) -> dict | None:
        return records.read(self.state, name)

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)  # a method: tests act on the host while a driver waits

    def run(self) -> None:
        drafted = self.options["random_drafter"] or bool(self.options.get("drafter"))
        for step in plan.plan_steps(self.names, self.variants, self.options["together"], drafted):
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

    # ---- the host, shared with other drivers ----
    def shares(self, kind: str, arg: str) -> bool:
        """Whether this step is taken from --share-state instead of run here."""
        if not self.options.get("share_state"):
            return False
        given = {"checkpoint": bool(self.options.get("checkpoint")), "drafter": bool(self.options.get("drafter"))}
        given |= {"quantize": arg in self.quantized, "bandwidth": False}
        return kind in given and not given[kind]

    def take_shared(self, step: str) -> None:
        """Wait for the other driver's step, then use what it made (its record is copied; its folders are read)."""
        shared = Path(self.options["share_state"])
        deadline = time.monotonic() + SHARED_WAIT_S
        while not (shared / "done" / step).exists():
            if (shared / "results" / f"failed-{step}.json").exists() or time.monotonic() > deadline:
                raise RuntimeError(f"{shared}: step {step} failed or did not finish")
            self.pause(5)
        record = shared / "results" / f"{step}.json"  # each of these steps records under its own name
        if record.exists():
            self.record(step, json.loads(record.read_text()) | {"shared_from": str(shared)})

    def probe_lock(self):
        return host_lock(records.PROBE_LOCK)

    def marker(self, name: str) -> str:
        return f"{os.getpid()}-{self.state.name}-{name}"

    def wait_quiet(self) -> bool:
        """Until no server on the host is starting (under the probe lock); False where QUIET_WAIT_S ran out first."""
        deadline = time.monotonic() + QUIET_WAIT_S
        while busy := on_host(records.STARTING):
            if time.monotonic() > deadline:
                self.log(f"{len(busy)} servers still starting after {QUIET_WAIT_S} s: probed anyway (host_busy)")
                return False
            self.pause(min(5.0, QUIET_WAIT_S / 10))
        return True

    def hold_room(self, names: list[str]) -> None:
        """Wait until the host's resident servers (any driver's) leave room for `names` with at most --max-resident
        others beside any probe, then mark them resident; under a lock of its own, so no two drivers take the last
        room at once. A group never waits on itself: its driver's earlier group was stopped before."""
        room, waited = self.options["max_resident"] + 1, False
        if len(names) > room:
            raise RuntimeError(f"a group of {len(names)} exceeds --max-resident {room - 1} by itself")
        while names:  # a relaunch's group with nothing left to serve takes no room
            with host_lock(records.RESIDENT.with_name(records.RESIDENT.name + ".lock")):
                held = on_host(records.RESIDENT)
                if len(held) + len(names) <= room:
                    for name in names:
                        mark(records.RESIDENT, self.marker(name), True)
                    return
            if not waited:
                self.log(f"{len(held)} servers resident on the host: {names} wait (--max-resident {room - 1})")
            waited = True
            self.pause(5.0)

    def others_resident(self, name: str) -> int:
        return sum(marker != self.marker(name) for marker in on_host(records.RESIDENT))

    # ---- steps ----
    def step_environment(self, _: str) -> None:
        """The GPU, the CPU, the date and the packages each bundle holds; a vLLM bundle of another release than
        --engine (the config's engine.vllm) fails the run here, before any GPU time is spent."""
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True).stdout.splitlines()[0].split(",")
        versions = {}
        for label, (site, packages) in BUNDLES.items():
            query = [sys.executable, "-c", VERSIONS, *packages]
            found = subprocess.run(query, env=dict(os.environ, PYTHONPATH=site), capture_output=True, check=True)
            versions[label] = json.loads(found.stdout)
        bundled, expected = versions["vllm_bundle"]["vllm"], self.options.get("engine")
        if expected and bundled.split("+", 1)[0] != expected:
            raise RuntimeError(f"the vLLM bundle at {SITE_VLLM} is {bundled}, not {expected} (--engine, engine.vllm)")
        name, driver, memory = [part.strip() for part in smi]
        environment = {"gpu": {"name": name, "driver": driver, "memory_total": memory}}
        environment |= {"versions": versions, "cpu": records.cpu_model(), "cpu_count": os.cpu_count()}
        self.record("environment", {"kind": "environment", "status": "ok", "date": time.strftime("%F"), **environment})

    def step_checkpoint(self, _: str) -> None:
        if self.options.get("checkpoint"):
            self.record("checkpoint", records.describe_checkpoint(self.model_dir))
            return
        shutil.rmtree(self.model_dir, ignore_errors=True)
        self._python([str(ROOT / "gpu_proof" / "build_checkpoint.py"), str(self.model_dir), str(self.state / "c.json")])
        self.record("checkpoint", json.loads((self.state / "c.json").read_text()))

    def step_bandwidth(self, _: str) -> None:
        """The GPU's copy bandwidth, measured as the latency probe measures it in a served container."""
        with self.probe_lock():
            done = subprocess.run([sys.executable, *BANDWIDTH_QUERY[1:]], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the bandwidth query exited {done.returncode}:\n{done.stderr[-3000:]}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        method = "lib.containers.BANDWIDTH_QUERY: torch copy between two 256 MiB buffers, bytes read + written"
        self.record("bandwidth", {"kind": "bandwidth", "status": "ok", "copy_gbps": measured["gbps"], "method": method})

    def step_drafter(self, _: str) -> None:
        if self.options.get("drafter"):
            total = sum(f.stat().st_size for f in self.drafter_dir.glob("*.safetensors"))
            record = {"kind": "drafter", "status": "ok", "given": str(self.drafter_dir), "total_bytes": total}
            self.record("drafter", record)
            return
        shutil.rmtree(self.drafter_dir, ignore_errors=True)
        args = [str(ROOT / "gpu_proof" / "build_checkpoint.py"), "--drafter", str(self.drafter_dir)]
        self._python([*args, str(self.state / "d.json"), "--target", str(self.model_dir)])
        self.record("drafter", json.loads((self.state / "d.json").read_text()))

    def step_quantize(self, recipe_key: str) -> None:
        """scripts/quantize.py (llmcompressor on CUDA) with the job rule quantize writes, as a program."""
        recipe = self.pipeline.recipes[recipe_key]
        if recipe_key in self.quantized:
            model = self.quantized[recipe_key]
            if not (model / "config.json").is_file():
                raise RuntimeError(f"--quantized {recipe_key}={model}: no config.json there")
            self.record(f"quantize-{recipe_key}", {"kind": "quantize", "status": "ok", "given": str(model)})
            return
        out = self.state / "quant" / recipe_key
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / "job.json").write_text(json.dumps(quantize_job(self.model_dir, recipe, out), indent=2) + "\n")
        env = {"PYTHONPATH": os.pathsep.join([SITE_LLMC, SITE_EXTRA]), "TOKENIZERS_PARALLELISM": "false"}
        started, status = time.monotonic(), "failed"
        try:
            self._python([str(ROOT / "scripts" / "quantize.py"), "--job", str(out / "job.json")], env, timeout=1800)
            status = "ok"
        finally:
            report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
            result = {"kind": "quantize", "status": status, "recipe": recipe, "report": report}
            self.record(f"quantize-{recipe_key}", result | {"wall_s": round(time.monotonic() - started, 1)})

    def step_lossless(self, _: str) -> None:
        """Each probed speculative variant against the run's no-speculation variant of its recipe (whose server
        also ran the reference requests: first runs with top logprobs, as rule lossless_reference records)."""
        from lib.lossless import compare, failures

        probed = {name: self.read(f"variant-{name}") for name in self.names}
        references = {r["recipe"]: r for r in probed.values() if r and r.get("reference")}
        checks = []
        for name, record in probed.items():
            if not record or record["speculative"]["method"] == "none" or not record.get("probe"):
                continue
            canary = (self.options.get("reference_for") or {}).get(name)
            reference = (probed.get(canary) or {}) if canary else references.get(record["recipe"])
            if not (reference or {}).get("reference"):
                recipe = record["recipe"]
                missing = f"reference of {canary} (--reference-for)" if canary else f"variant of recipe {recipe}"
                check = {"variant": name, "reference_variant": None, "passed": False, "rows": []}
                checks.append(check | {"failures": [f"no {missing} without speculation in this run"]})
                continue
            rows = compare(record["probe"], reference["reference"])
            check = {"variant": name, "reference_variant": reference["variant"], "rows": rows}
            if canary:
                check["canary"] = "checked against another variant's reference: it must fail"
            checks.append({**check, "passed": not failures(rows), "failures": failures(rows)})
        self.record("lossless", {"kind": "lossless", "status": "ok", "checks": checks})

    def step_serve(self, group: str) -> None:
        """Start the group's servers together once the host has room for them (--max-resident), probe them one at a
        time, stop them. A variant that fails is recorded as failed and the others go on; one probed before (a
        relaunch) is skipped."""
        members = plan.groups(self.names, self.options["together"])[f"serve-{group}"]
        names = [n for n in members if (self.read(f"variant-{n}") or {}).get("status") != "ok"]
        running, failed = {}, []
        self.hold_room(names)
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
                    mark(records.STARTING, self.marker(name), False)
                record["cold_start"]["seconds"] = round(time.monotonic() - started, 1)  # from its own start
                self.log(f"{name}: ready after {record['cold_start']['seconds']:.0f} s")
                self.record(f"variant-{name}", record)
            for name, (_, base, _, record, _) in running.items():
                try:
                    self.probe_variant(name, base, record)
                except Exception as error:  # noqa: BLE001
                    failed.append(self.fail(name, record, error))
            for name in [n for n in running if n not in failed and n in (self.options.get("alone") or [])]:
                for other in [n for n in running if n != name]:  # the group's others leave the host
                    self.stop(running[other][0])
                    mark(records.RESIDENT, self.marker(other), False)
                try:
                    self.probe_alone(name, running[name][1], running[name][3])
                except Exception as error:  # noqa: BLE001
                    failed.append(self.fail(name, running[name][3], error))
            for name in [n for n in running if n not in failed and n in (self.options.get("restart") or [])]:
                self.stop(running[name][0])
                mark(records.RESIDENT, self.marker(name), True)  # again, where --alone stopped it
                try:
                    running[name] = self.restart(name, running[name], len(names))
                except Exception as error:  # noqa: BLE001
                    failed.append(self.fail(name, running[name][3], error))
        finally:
            for proc, *_ in running.values():
                self.stop(proc)
            for name in names:
                mark(records.STARTING, self.marker(name), False)
                mark(records.RESIDENT, self.marker(name), False)
        first = next((self.state / "cache" / n for n in running if n not in failed), None)
        if first is not None and not (self.state / "cache" / "kernels.tar").exists():
            with tarfile.open(self.state / "cache" / "kernels.tar", "w") as archive:
                for sub in [sub for sub in KERNEL_CACHES if (first / sub).is_dir()]:
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
        if not plan.quantizes(recipe):
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
        env = {"SERVE_CONFIG": str(serve_json), "MODEL_DIR": str(model), "DRAFT_DIR": str(self.drafter_dir)}
        env |= {"HOST": "127.0.0.1", "PORT": str(port), "CACHE_DIR": str(cache), "PYTHONPATH": SITE_VLLM}
        env = os.environ | env | {"VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", **self.serve_env}
        env = {key: value for key, value in env.items() if key not in CACHE_DIRS}  # serving/launch.py derives them
        log_path = self.results / "logs" / f"{name}{'-restart' if restart else ''}.log"
        with open(log_path, "w") as handle:
            self.log(f"{name}: starting `python3 -m serving` on port {port}")
            mark(records.STARTING, self.marker(name), True)
            proc = subprocess.Popen(
                self.serve_cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
        variant = self.variants[name]
        drafted = variant["speculative"]["method"] == "dflash"
        record = {"kind": "variant", "status": "running", "variant": name, "recipe": variant["recipe"]}
        record |= {"config": self.options.get("config", "config.yaml"), "speculative": variant["speculative"]}
        record |= {"serve": settings, "options": options, "serve_env": self.serve_env, "weights": part_bytes(model)}
        record["cold_start"] = {"cache": "seeded" if seeded else "empty", "together": together}
        record["drafter_bytes"] = sum(p.stat().st_size for p in self.drafter_dir.glob("*.safetensors") if drafted)
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
            mark(records.STARTING, self.marker(name), False)
        warm = {"cache": "the first start's (what bake_compile_cache ships)", "together": together}
        warm |= {"seconds": round(time.monotonic() - started, 1)}
        record["warm_start"] = warm | {"compile_log": compile_lines(log_path.read_text(errors="replace"))}
        record["cold_start"]["compile_log"] = compile_lines(first_log)
        self.log(f"{name}: restarted on its own cache, ready after {record['warm_start']['seconds']:.0f} s")
        self.record(f"variant-{name}", record)
        return proc, base, log_path, record, started

    def probe_settings(self) -> dict:
        return {**self.pipeline.config["probe"], "warmup": self.options["warmup"], "runs": self.options["runs"]}

    def timed_probe(self, name: str, base: str, record: dict) -> tuple[dict, int, float]:
        """One probe of `name`'s server once no server on the host is starting (else `host_busy`): its result, the
        most other servers resident at its start and end, its seconds. The caller holds the host lock."""
        settings = self.probe_settings()
        if not self.wait_quiet():
            record["host_busy"] = True
        resident, started = self.others_resident(name), time.monotonic()
        result = probe(
            base, record["serve"]["served_model_name"], settings, str(ROOT / settings["varied_text"]), self.log
        )
        result.update(warmup=settings["warmup"], runs=settings["runs"])
        return result, max(resident, self.others_resident(name)), round(time.monotonic() - started, 1)

    def probe_alone(self, name: str, base: str, record: dict) -> None:
        """--alone: the same server probed again once its group's other servers are stopped, so its record holds the
        one variant beside N resident servers and beside none (what --max-resident is decided from)."""
        with self.probe_lock():
            result, resident, seconds = self.timed_probe(name, base, record)
        record["alone"] = {"probe": result, "resident_servers": resident, "probe_s": seconds}
        self.record(f"variant-{name}", record)

    def probe_variant(self, name: str, base: str, record: dict) -> None:
        """The probe, under the host lock once no server on the host is starting, counting the other servers resident
        at its start and end; then, on the same server, the lossless reference where this run needs one."""
        settings = self.probe_settings()
        model_name = record["serve"]["served_model_name"]
        varied = str(ROOT / settings["varied_text"])
        speculative = [n for n in self.names if self.variants[n]["speculative"]["method"] != "none"]
        with self.probe_lock():
            record["probe"], record["resident_servers"], record["probe_s"] = self.timed_probe(name, base, record)
            record["bytes_per_step"] = records.bytes_per_step(record)
            self.record(f"variant-{name}", record)
            if name in (self.options.get("reference_for") or {}).values() or (
                record["speculative"]["method"] == "none"
                and any(self.variants[n]["recipe"] == record["recipe"] for n in speculative)
            ):  # the lossless reference: first runs with their top logprobs
                record["reference"] = probe(base, model_name, dict(settings, first_run_only=True), varied, self.log)
        record["status"] = "ok"
        self.record(f"variant-{name}", record)

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

    def _python(self, args: list[str], env: dict | None = None, timeout: float | None = None) -> None:
        log_path = self.results / "logs" / f"{Path(args[0]).stem}-{len(list(self.done.iterdir()))}.log"
        with open(log_path, "w") as handle:
            env = dict(os.environ, **(env or {}))
            cmd = [sys.executable, "-u", *args]
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(args[0]).name} exited {done.returncode}:\n{tail(log_path)}")
