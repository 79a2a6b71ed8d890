"""vLLM general plugin (entry point in _dist/): on vLLM's CPU build, start the engine core and its worker by fork.

Why: vLLM's CPU platform forces `spawn` for every process it starts, so a server imports vLLM, torch and
transformers three times in a row: the API server, then the engine core it spawns, then the worker the engine
core spawns; on a small CPU the second and third are a large part of a container's start. Both parents have all of
it imported already; a forked child starts at once. (vLLM forks its workers by default on GPUs; the CPU platform is
what forces spawn.)

What spawn gave that a fork must keep:
- The worker's OpenMP binding. vLLM sets it in environment variables around the worker's start (`OMP_NUM_THREADS`
  and `GOMP_CPU_AFFINITY`, or `OMP_PLACES` with `OMP_PROC_BIND`), which the OpenMP runtime reads only when it
  loads. A forked worker has it loaded already, so it applies them itself before anything runs (`replay_binding`):
  the CPUs become its affinity, which its OpenMP threads inherit (on one CPU, the tiny profile's worker on two
  cores, that is the runtime's own binding; on several, the threads share them instead of taking one each), and
  the thread count becomes OMP_NUM_THREADS (else one per CPU, the runtime's default).
- A child whose OpenMP runtime works. GNU OpenMP's thread pool does not survive a fork: a child forked after its
  parent ran a parallel region on more than one thread hangs at its own first one. So the API
  server, which does no model work, runs on one OpenMP thread from the moment this plugin loads (right after its
  imports, which run no parallel region); the engine core it forks inherits that and does no model work either;
  and a process forks only while it still runs one OpenMP thread and is that API server or a child forked from
  it (`fork_refusal`). Otherwise (a spawned engine core, Intel OpenMP preloaded) vLLM spawns as before and the log
  says why. Off by default (serve.patches.fork_start; config/tiny.yaml turns it on).
GPU platforms are left alone (CUDA cannot be forked once initialized).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import socket
import sys

from serving.launch import API_SERVER_MODULE
from serving.patches import guarded

_LOGGER = "vllm.plugins.serving_fork_start"
# OpenMP runtimes that vLLM binds through KMP_AFFINITY, which they read only when they load
INTEL_OPENMP = ("libiomp", "libomp")
BINDING_KEYWORDS = ("true", "close", "spread", "master", "primary")
_single_threaded = {"since_start": False}  # set in the API server; a forked child inherits it


def places_cpus(places: str) -> set[int] | None:
    """The CPUs of an `OMP_PLACES` value as vLLM writes it ("{0,1,2}"); None for any other form."""
    body = places.strip()
    if not (body.startswith("{") and body.endswith("}")):
        return None
    try:
        cpus = {int(x) for x in body[1:-1].split(",") if x.strip()}
    except ValueError:
        return None
    return cpus or None


def affinity_cpus(environ: dict) -> set[int] | None:
    """The CPUs the OpenMP runtime would bind to: GNU's `GOMP_CPU_AFFINITY` ("0 1 2", what vLLM writes when
    libgomp is preloaded, as its CPU platform does itself) or `OMP_PLACES` with `OMP_PROC_BIND`."""
    gomp = environ.get("GOMP_CPU_AFFINITY", "").split()
    if gomp and all(x.isdigit() for x in gomp):
        return {int(x) for x in gomp}
    if environ.get("OMP_PROC_BIND", "").lower() in BINDING_KEYWORDS:
        return places_cpus(environ.get("OMP_PLACES", ""))
    return None


def replay_binding(environ: dict, set_threads, set_affinity, get_affinity) -> list[str]:
    """Apply in a forked worker what its OpenMP runtime would have read from `environ` at load; returns what it
    set. The affinity first, so that the default thread count is one per CPU the process may use."""
    done = []
    cpus = affinity_cpus(environ)
    if cpus is not None:
        set_affinity(cpus)
        done.append(f"cpus {sorted(cpus)}")
    count = environ.get("OMP_NUM_THREADS", "")
    threads = int(count) if count.isdigit() and int(count) > 0 else len(get_affinity())
    set_threads(threads)
    done.append(f"{threads} OpenMP threads")
    return done


def mapped_libraries(maps: str = "/proc/self/maps") -> set[str]:
    """Real paths of the shared objects this process has loaded."""
    with open(maps) as f:
        return {os.path.realpath(line.split()[-1]) for line in f if ".so" in line.rsplit("/", 1)[-1]}


def fork_refusal(environ: dict, single_threaded_since_start: bool, openmp_threads: int, loaded: set[str]) -> str | None:
    """Why this process must not fork its vLLM child (None: it may). `loaded`: mapped_libraries()."""
    if not single_threaded_since_start:
        return "this process did not run on one OpenMP thread from its start (a thread pool may exist)"
    if openmp_threads != 1:
        return f"this process runs {openmp_threads} OpenMP threads now (a thread pool may exist)"
    for lib in filter(None, environ.get("LD_PRELOAD", "").replace(" ", ":").split(":")):
        name = os.path.basename(lib)
        if name.startswith(INTEL_OPENMP):
            return f"{name} is preloaded: vLLM binds it through KMP_AFFINITY, which it reads only when it loads"
        if name.startswith("libgomp") and os.path.realpath(lib) not in loaded:
            return f"{lib} is preloaded for vLLM's children but is not the OpenMP runtime loaded here"
    return None


def close_network_sockets(fds=None) -> list[int]:
    """Close this process's TCP/IP sockets (of `fds`, default all its descriptors); returns their numbers. A forked
    child starts with copies of its parent's, which a spawned child never had: the API server's HTTP port among
    them (bound before the engine starts, listening after), which would otherwise outlive the API server in its
    children. Unix sockets stay: multiprocessing's own pipes between parent and child can be socket pairs."""
    closed = []
    for fd in fds if fds is not None else sorted(int(x) for x in os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket, or closed meanwhile (listdir's own descriptor)
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.close()
            closed.append(fd)
        else:
            sock.detach()
    return closed


class _ForkedProcess(multiprocessing.context.ForkProcess):
    """What a spawned child starts without: its parent's signal wake-up pipe (the API server's event loop's) and
    network sockets."""

    def run(self):
        signal.set_wakeup_fd(-1)
        close_network_sockets()
        super().run()


class _WorkerProcess(_ForkedProcess):
    """The worker, forked: first the OpenMP binding vLLM set in the environment for it, then vLLM's code."""

    def run(self):
        import torch

        applied = replay_binding(os.environ, torch.set_num_threads, _set_affinity, lambda: os.sched_getaffinity(0))
        _logger().info("fork start: %s bound to %s", self.name, ", ".join(applied))
        super().run()


def _set_affinity(cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)


class _EngineCoreContext(multiprocessing.context.ForkContext):
    # nothing to replay: the engine core keeps its parent's single OpenMP thread (it does no model work), so it
    # may fork its worker in turn
    Process = _ForkedProcess


class _WorkerContext(multiprocessing.context.ForkContext):
    Process = _WorkerProcess


def _logger():
    from vllm.logger import init_logger

    return init_logger(_LOGGER)


def forking_context(original, role: str, context):
    """vLLM's get_mp_context for the `role` process: `context` (fork) where fork_refusal allows, else
    `original()` (vLLM's spawn)."""

    def get_mp_context():
        import torch

        refusal = fork_refusal(os.environ, _single_threaded["since_start"], torch.get_num_threads(), mapped_libraries())
        if refusal is None:
            _logger().info_once("fork start: the %s is forked, not spawned", role)
            return context
        _logger().info_once("fork start: the %s is spawned: %s", role, refusal)
        return original()

    get_mp_context.serving_fork_start = True
    return get_mp_context


def _is_api_server(main) -> bool:
    """This process is the API server serving.launch execs (`python -m API_SERVER_MODULE`), not a process that
    loads vLLM's plugins to run a model itself."""
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) == API_SERVER_MODULE


@guarded("fork_start")
def register() -> None:
    if _is_api_server(sys.modules.get("__main__")):
        import torch

        torch.set_num_threads(1)
        _single_threaded["since_start"] = True
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.executor import multiproc_executor

    for module, role, context in (
        (engine_utils, "engine core", _EngineCoreContext()),
        (multiproc_executor, "worker", _WorkerContext()),
    ):
        if not getattr(module.get_mp_context, "serving_fork_start", False):
            module.get_mp_context = forking_context(module.get_mp_context, role, context)
