"""``specray serve``: start, warm up, say what runs, serve until SIGINT/SIGTERM, stop cleanly.

Safe to leave running:

* a port already in use is an error before anything starts (Ray Serve's proxy would
  otherwise share it with the other server, and requests would be split between the two);
* a local Ray started here listens on the loopback interface only when ``--host`` is a
  loopback address (Ray binds its gRPC servers to 127.0.0.1 only when its node IP is that);
* the server answers a warm-up request before it says "ready" (the first request of a
  fresh server loads the models into the workers and pays torch's first-call costs);
* SIGINT and SIGTERM drain, then shut Serve down, then Ray, and exit 0 (Ray's own SIGTERM
  handling in the driver aborts the process with a native stack dump): new requests get 503,
  those in flight get ``--graceful-shutdown-s`` to finish, and what is left then ends with an
  error (a 503; a stream, an error event as its last).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

from specray.entrypoints.processes import descendants, reap

log = logging.getLogger("specray")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WARMUP_PROMPT = "def fibonacci(n):\n    "
ONCE_MAX_TOKENS = 48


class _Stop(Exception):
    """SIGINT or SIGTERM arrived."""


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served, or None. Binding without SO_REUSEPORT fails while
    any other socket listens there (Ray's proxy binds with it, so a second one would share)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"--host {host}: {exc.strerror}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no problem
        try:
            s.bind(address)
        except PermissionError:
            return f"--port {port}: permission denied on {host} (ports below 1024 need privileges)"
        except OSError as exc:
            return f"--port {port}: {host}:{port} is already in use ({exc.strerror}); stop that server or pick another --port"
    return None


def _http(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    """POST (or GET) JSON with the standard library: the main job needs nothing else."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}


def startup_lines(cfg, plan) -> list[str]:
    """What runs: device, dtype, attention kernel, KV cache and the methods available."""
    from specray.engine.params import best_speculation
    from specray.engine.quantization import describe_plan
    from specray.kernels.backends import attention_backend

    engine = cfg.engine.engine_config()
    device, dtype = engine.resolved_device, engine.resolved_dtype
    kernel, why = attention_backend(device.split(":")[0])
    methods = sorted(cfg.engine.method_facts())
    default = cfg.engine.default_speculation or best_speculation(methods)
    given = default.model_dump(exclude_unset=True) if cfg.engine.default_speculation is not None else None
    how = f"{json.dumps(given)} (--speculative-config)" if given else f"{default.method} (self-tuning length)"
    return [
        f"model {cfg.model_name!r}: target {cfg.engine.target}" + (f", draft {cfg.engine.draft}" if cfg.engine.draft else ""),
        f"device {device}, dtype {dtype}" + (" (auto)" if cfg.engine.dtype == "auto" else ""),
        _parallel_line(cfg.engine),
        f"attention {kernel}: {why}",
        describe_plan(engine.target, engine.draft, engine.quantization, engine.draft_quantization, engine.fp8_kernel),
        f"KV cache: {plan.describe()}",
        f"methods: {', '.join(methods)}; requests without `speculation` use {how}",
    ]


def _parallel_line(engine) -> str:
    """How the models are split: tensor parallel ranks of the target, and where the draft runs."""
    tp = engine.tensor_parallel_size
    if tp == 1:
        return "tensor parallel size 1 (the target whole on one device)"
    draft = ("the draft split over the same ranks" if engine.draft_tp == tp
             else "drafters whole (draft tensor parallel size 1)")
    return f"tensor parallel size {tp}: the target split over {tp} ranks, one actor and device each; {draft}"


def serve_main(args) -> int:
    from specray.entrypoints.defaults import with_demo_pair
    from specray.entrypoints.flags import check_tokenizer, check_weights, engine_settings, load_config_file

    file_data = load_config_file(args.config)
    cfg = engine_settings(args, file_data)
    problem = port_problem(cfg.host, cfg.port)
    if problem:
        raise ValueError(problem)
    engine = with_demo_pair(cfg.engine)  # the demo pair when no target is given (built once)
    check_tokenizer(engine)  # before Ray starts: one line naming the flag
    check_weights(engine, args, file_data)
    plan = engine.kv_plan()  # the KV cache's size: given, sized from GPU memory, or the CPU default
    engine = engine.with_plan(plan)
    cfg = cfg.model_copy(update={"engine": engine})
    for line in startup_lines(cfg, plan):
        print(f"specray: {line}", flush=True)
    local = args.address is None and not os.environ.get("RAY_ADDRESS")
    if local and cfg.host in LOOPBACK:
        # Ray binds its servers to 127.0.0.1 only when the node's IP is the loopback one; for
        # a single machine it picks that IP when it thinks it is not a cluster node.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if local and cfg.host in LOOPBACK:
        import ray._private.ray_constants as ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    stop: list = []
    _install_signal_handlers(stop)
    started = False
    try:
        started = True
        _start(cfg, args.address, local)
        _install_signal_handlers(stop)  # again: ray.init installs its own SIGTERM handler in the driver
        url = f"http://{_url_host(cfg.host)}:{cfg.port}{(cfg.route_prefix or '/').rstrip('/')}"
        headers = {"Authorization": f"Bearer {cfg.resolved_api_key()}"} if cfg.resolved_api_key() else {}
        warmed, seconds = _warm_up(url, cfg, headers)
        print(f"specray: warm: {warmed} requests answered in {seconds:.1f} s (models loaded, first calls paid)",
              flush=True)
        learning = LearningReport(url, headers) if cfg.engine.online_learning.enabled and args.once is None else None
        if learning is not None:
            learning.wait_for_trainer()
        print(f"specray: ready: serving {cfg.model_name!r} at {url}/v1 (playground: {url}/playground)", flush=True)
        if args.once is not None:  # one request over HTTP, then stop (the README's main job)
            status, reply = _http(f"{url}/v1/completions", {"model": cfg.model_name, "prompt": args.once,
                                                             "max_tokens": ONCE_MAX_TOKENS, "temperature": 0}, headers)
            print(json.dumps(reply, indent=2), flush=True)
            return 0 if status == 200 and "choices" in reply else 1
        print(f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{cfg.model_name}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32}}'",
              flush=True)
        while not stop:
            if learning is None:
                time.sleep(3600)
            else:
                learning.report()
                time.sleep(LEARNING_POLL_S)
    except _Stop:
        _drain(cfg.graceful_shutdown_s)
    finally:
        _shutdown(ray, started, local)
    print("specray: stopped", flush=True)
    return 0


LEARNING_POLL_S = 2.0
TRAINER_WAIT_S = 300.0


class LearningReport:
    """Online learning in the server's own output: where the trainer runs (or what it waits
    for), and each training round's gate decision as it happens (``GET /v1/drafters``)."""

    def __init__(self, url: str, headers: dict):
        self.url, self.headers = url, headers
        self.placement: str | None = None
        self.last_round = 0.0  # the finish time of the last round said

    def wait_for_trainer(self) -> None:
        """Before "ready": the trainer's process is up and polling (its first round then starts
        as soon as traces are there, not a process start later), or it cannot be placed (said:
        serving goes on without it). Bounded: a trainer still starting after TRAINER_WAIT_S is
        said and served around."""
        start = time.monotonic()
        while time.monotonic() - start < TRAINER_WAIT_S:
            body = self._status()
            trainer = (body or {}).get("trainer") or {}
            if trainer.get("seen") is not None:
                print(f"specray: online learning: the trainer is up ({time.monotonic() - start:.1f} s)", flush=True)
                return
            if str(trainer.get("state", "")).startswith("pending"):
                self.report(body)
                return
            time.sleep(0.5)
        print(f"specray: online learning: the trainer has not started after {TRAINER_WAIT_S:.0f} s; serving without "
              "it until it does", flush=True)

    def _status(self) -> dict | None:
        try:
            status, body = _http(f"{self.url}/v1/drafters", headers=self.headers, timeout=30)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        return body if status == 200 else None

    def report(self, body: dict | None = None) -> None:
        from specray.actors.learner import round_line

        body = body if body is not None else self._status()
        if body is None:
            return
        placement = (body.get("trainer") or {}).get("placement")
        if placement and placement.get("message") != self.placement:
            self.placement = placement["message"]
            print(f"specray: online learning: {self.placement}", flush=True)
        for r in body.get("rounds") or []:
            if r["time"] > self.last_round:
                self.last_round = r["time"]
                print(f"specray: online learning: {round_line(r)}", flush=True)


def _drain(grace_s: float) -> None:
    """Stop taking requests, give those in flight ``grace_s`` to finish, end the rest (each
    gets its error: a 503, a stream its last event), then return (shutting down follows)."""
    from ray import serve

    try:
        ingress = serve.get_app_handle("specray")
        ingress.drain.remote().result(timeout_s=30)
        left = ingress.in_flight.remote().result(timeout_s=30)
        if left:
            print(f"specray: draining: {left} requests in flight, up to {grace_s:g} s to finish", flush=True)
        deadline = time.monotonic() + grace_s
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = ingress.in_flight.remote().result(timeout_s=30)
        if left:
            print(f"specray: ending {ingress.expire.remote().result(timeout_s=30)} requests still in flight",
                  flush=True)
            deadline = time.monotonic() + 5  # their final events reach the clients
            while ingress.in_flight.remote().result(timeout_s=30) and time.monotonic() < deadline:
                time.sleep(0.1)
    except Exception as exc:  # noqa: BLE001 - not started yet, or already going: shut down anyway
        log.warning("could not drain the requests in flight: %s", exc)


def _install_signal_handlers(stop: list) -> None:
    """SIGINT/SIGTERM raise _Stop in the main thread (which then shuts down in order)."""

    def handler(signum, frame):
        if stop:  # a second signal while shutting down: let it finish
            return
        stop.append(signum)
        raise _Stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _start(cfg, address: str | None, local: bool) -> None:
    import ray
    from ray import serve

    from specray.entrypoints.app import build_app

    if local:
        hook = {"worker_process_setup_hook": "specray.entrypoints.serving.loopback_worker"} if cfg.host in LOOPBACK else {}
        # address="local": ray.init() alone joins the cluster `ray start` last left on this
        # machine (/tmp/ray/ray_current_cluster), and a stopped server would shut its Serve down
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env=hook)
    else:
        ray.init(address=address, log_to_driver=False)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its start-up lines repeat ours
    serve.start(http_options={"host": cfg.host, "port": cfg.port}, logging_config={"log_level": "WARNING"})
    serve.run(build_app(cfg), name="specray",
              route_prefix=cfg.route_prefix, blocking=False)


def loopback_worker() -> None:
    """In each worker of a loopback-only local Ray: Serve replicas open their
    inter-deployment gRPC server on every interface ("[::]:0", hard-coded); bind it to the
    loopback interface instead, which is where the rest of this Ray listens and connects."""
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server
    if getattr(bind, "specray_loopback", False):
        return

    def loopback(server, address: str):
        return bind(server, address.replace("[::]:", "127.0.0.1:", 1))

    loopback.specray_loopback = True
    replica.add_port_to_grpc_server = loopback


def _warm_up(url: str, cfg, headers: dict) -> tuple[int, float]:
    """Completions before "ready" (two per replica): they start each replica's workers (the
    models load there) and pay torch's first-call costs, so a user's first request runs at
    the speed of later ones. Returns (requests answered, seconds)."""
    from specray.serve.deployment import START_FAILED

    start = time.monotonic()
    deadline = start + 600
    body = {"model": cfg.model_name, "prompt": WARMUP_PROMPT, "max_tokens": ONCE_MAX_TOKENS, "temperature": 0}
    replicas = cfg.autoscaling.min_replicas if cfg.autoscaling is not None else cfg.num_replicas
    for _ in range(max(1, replicas) * 2):
        while True:
            try:
                status, reply = _http(f"{url}/v1/completions", body, headers, timeout=600)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                status, reply = 0, {}
            if status == 200:
                break
            error = reply.get("error") if isinstance(reply.get("error"), dict) else {}
            if error.get("type") == START_FAILED:  # it will not start: say why, never wait on it
                raise ValueError(error.get("message"))
            if 400 <= status < 500 or time.monotonic() > deadline:
                raise RuntimeError(f"the warm-up request failed ({status}): {json.dumps(reply)}")
            time.sleep(0.5)
    return max(1, replicas) * 2, time.monotonic() - start


def _shutdown(ray, started: bool, local: bool) -> None:
    """A local Ray goes down with everything on it (replicas, proxies, workers): nothing
    else uses it. On a cluster only this application is removed; the cluster stays."""
    from ray import serve

    if started and not local:
        try:
            serve.delete("specray")
        except Exception as exc:  # noqa: BLE001 - the cluster may be going away
            log.warning("could not remove the application: %s", exc)
    if ray.is_initialized():
        logging.getLogger("ray.serve").addFilter(_late_consume)
        ours = descendants() if local else []
        ray.shutdown()
        reap(ours)


def _late_consume(record: logging.LogRecord) -> bool:
    """Drop Ray Serve's "failed to consume generator ref" error when it comes from shutting
    down. Ray Serve (2.60) advances each unary handle call's stream from a readiness callback
    on a core-worker thread. The drain's last call returns before that callback has run, so it
    can run after ``ray.shutdown()`` and log "Ray has not been started yet". The reply was
    already received, so nothing is lost. Installed only as Ray goes down, and only that error
    (Ray gone under it) is dropped."""
    late = record.getMessage().startswith("failed to consume generator ref")
    return not (late and record.exc_info is not None and "has not been started" in str(record.exc_info[1]))


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)


if __name__ == "__main__":
    from specray.entrypoints.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
