"""Shared fixtures: tiny random models (fast, no training) and the demo pair (slow)."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch

pytest_plugins = ["tests.serving"]  # Serve's proxy and the shared applications

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
TESTS_PATH = os.path.join(ROOT, ".test-path")
"""Where ``tests`` imports from (a folder holding a link to tests/): never the root itself."""
# One import name per module: the root folders (engine/, protocol/, ...) are `specray.*` and
# nothing else, so the root leaves sys.path (`python -m pytest` and xdist's workers put it
# first); `tests.*` comes from TESTS_PATH (pyproject's pythonpath).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Serve's controller kills an HTTP proxy that is not ready within 5 s (health checks: 10 s), and
# serve.start then fails with the proxy "killed by ray.kill". On 2 shared cores, with the other
# xdist worker busy, a proxy's start can take longer. The in-process cluster's
# processes inherit these from the driver; serve.start itself waits 60 s at most.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
# Small models on 2 shared cores: one thread is faster and far less noisy.
torch.set_num_threads(1)
# The `compile` step's capture (fullgraph, one graph per function, no recompiles, outputs equal
# to eager) is what most tests prove: aot_eager traces the same graphs without generating and
# compiling C++ (minutes of gcc per process on 2 cores). Tests marked `inductor` run the real
# kernels (the `inductor` fixture); Ray actors and subprocesses inherit this.
os.environ.setdefault("SPECRAY_COMPILE_BACKEND", "aot_eager")
# Engines start without the verification budget's cost profile (about a CPU-second each, a
# quarter of the fast tier, and read from a machine whose load the other worker sets): the
# budget's table then fills from served steps, optimistic where unmeasured, so every method
# drafts from its first steps. Tests of the profile ask for it (``profile_costs=True``); the
# commands started as users start them (tests/test_serve_cli.py, `serve run`) run without this.
os.environ.setdefault("SPECRAY_PROFILE_COSTS", "0")


@pytest.fixture()
def inductor(monkeypatch):
    """This test's `compile` step generates inductor's kernels, as users get them."""
    monkeypatch.setenv("SPECRAY_COMPILE_BACKEND", "inductor")


def pytest_sessionstart(session):
    """The whole suite builds the demo pair first (a few CPU minutes, once; later runs find it
    cached), before any test and so outside every test's timeout; xdist workers then find it
    built. Runs of chosen files, of ``-m "not slow"`` and xdist workers skip this."""
    cfg = session.config
    controller = getattr(cfg.option, "numprocesses", None) and not hasattr(cfg, "workerinput")  # xdist's
    if "not slow" in (cfg.option.markexpr or "") and not controller:
        _forbid_processes()
    if hasattr(cfg, "workerinput") or cfg.option.collectonly or "not slow" in (cfg.option.markexpr or ""):
        return
    suite = {os.path.normpath(os.path.join(str(cfg.rootpath), p)) for p in cfg.getini("testpaths")}
    if not cfg.args or any(os.path.normpath(os.path.join(str(cfg.invocation_params.dir), a)) not in suite
                           for a in cfg.args):
        return
    from specray.demo import load_or_build_demo_pair

    load_or_build_demo_pair()


PROCESS_FIXTURES = {"ray_session"}
"""A test that uses one of these (every Ray and Serve fixture depends on it) starts processes:
it is ``slow``, out of the fast tier. Tests that start processes otherwise carry the mark."""
DURATIONS = os.path.join(os.path.dirname(os.path.realpath(__file__)), "durations.json")
"""Seconds each file took in a full run (``pytest --store-durations``, as pytest-split keeps
them): xdist hands whole files to whichever worker is free, so the longest go first, or one
would run alone at the end while the other worker idles."""


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help="write each file's seconds to tests/durations.json (the order files start in)")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False


SHARED_GROUPS = {
    "serve-apps": {"main_url", "guarded_url", "demo_url"},
    "coordinators": {"tiny_coordinator", "tiny_colocated_coordinator", "colocated_url"},
}
"""Session fixtures that start applications or coordinators (tests/serving.py): the files that
use one run on one xdist worker, so each starts once per run instead of once per worker."""


def _group(fixtures: set) -> str | None:
    return next((name for name, used in SHARED_GROUPS.items() if used & fixtures), None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Process-starting tests marked ``slow``; under xdist, a file that uses a shared
    application or coordinator joins that fixture's group (a ``@group`` suffix on its test ids,
    as xdist's loadgroup writes it); the longest files and groups first."""
    files: dict[str, set] = {}
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        files.setdefault(item.path.name, set()).update(used)
        if PROCESS_FIXTURES & used:
            item.add_marker(pytest.mark.slow)
    try:
        with open(DURATIONS) as fh:
            seconds = json.load(fh)
    except (OSError, ValueError):
        seconds = {}
    group = {name: _group(used) for name, used in files.items()}
    scope = {name: group[name] or name for name in files}
    total: dict[str, float] = {}
    for name in files:
        total[scope[name]] = total.get(scope[name], 0.0) + seconds.get(name, 0.0)
    if hasattr(config, "workerinput"):
        for item in items:
            if group[item.path.name]:
                item._nodeid = f"{item.nodeid}@{group[item.path.name]}"
    items.sort(key=lambda item: (-total[scope[item.path.name]], scope[item.path.name]))


def pytest_xdist_make_scheduler(config, log):
    """Whole files to whichever worker is free, as ``--dist loadfile``; a group's files (the
    ``@group`` suffix above) as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Grouped(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.rsplit("@", 1)[1]
            return super()._split_scope(nodeid)

    return Grouped(config, log)


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    name = os.path.basename(report.location[0])
    _seconds[name] = _seconds.get(name, 0.0) + report.duration


def pytest_sessionfinish(session):
    worker = hasattr(session.config, "workerinput")  # xdist's controller gets every report
    if session.config.getoption("--store-durations") and _seconds and not worker:
        with open(DURATIONS, "w") as fh:
            json.dump({k: round(v, 1) for k, v in sorted(_seconds.items(), key=lambda kv: -kv[1])}, fh, indent=1)


def _forbid_processes() -> None:
    """The fast tier starts no process: a test that would (a subprocess, a fork, Ray) fails
    here, naming itself, instead of quietly making the tier slow."""
    import multiprocessing
    import subprocess

    def refuse(*args, **kwargs):
        raise RuntimeError("the fast tier starts no process: mark this test `slow`")

    subprocess.Popen.__init__ = refuse
    multiprocessing.Process.start = refuse
    try:
        import ray
    except ImportError:
        return
    ray.init = refuse


ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/"
"""Token id i of the tiny models is the character ALPHABET[i] (64 ids, the tiny vocab)."""
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}ZZ{% endif %}"
)


def encode(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


def decode(ids) -> str:
    return "".join(ALPHABET[i] for i in ids)


def save_char_tokenizer(path) -> None:
    """A BPE without merges over the 64 symbols: text <-> token ids one to one (the serve tests'
    tokenizer for the tiny models)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(ALPHABET)}, merges=[]))
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE
    ).save_pretrained(str(path))


def tiny_llama(vocab: int = 64, layers: int = 2, seed: int = 0, init: float = 0.3, kv_heads: int = 2):
    """A random LlamaForCausalLM; a large init keeps argmax margins far above float noise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_pair():
    """(target, draft): a 2-layer target and a 1-layer draft sharing a 64-token vocab."""
    return tiny_llama(layers=2, seed=0), tiny_llama(layers=1, seed=1)


@pytest.fixture()
def make_engine(tiny_pair):
    """Build an LLMEngine around copies of the tiny pair."""
    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine

    def make(max_num_seqs: int = 4, draft=True, **kw):
        target, d = tiny_pair
        return LLMEngine(
            EngineConfig(target="<in-memory>", max_num_seqs=max_num_seqs, **kw),
            target_model=copy.deepcopy(target),
            draft_model=copy.deepcopy(d) if draft else None,
        )

    return make


def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """The reference: HF generate, greedy, batch 1."""
    out = model.generate(
        torch.tensor([list(prompt_ids)]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def demo_pair():
    from specray.demo import load_or_build_demo_pair

    return load_or_build_demo_pair()


@pytest.fixture(scope="session")
def demo_models(demo_pair):
    """(target, draft, tokenizer) loaded once per session."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(demo_pair.target).eval()
    draft = AutoModelForCausalLM.from_pretrained(demo_pair.draft).eval()
    tok = AutoTokenizer.from_pretrained(demo_pair.tokenizer)
    return target, draft, tok


@pytest.fixture()
def demo_engine(demo_models):
    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine

    def make(max_num_seqs: int = 4, **kw):
        target, draft, tok = demo_models
        return LLMEngine(
            EngineConfig(target="<in-memory>", max_num_seqs=max_num_seqs, **kw),
            target_model=copy.deepcopy(target),
            draft_model=copy.deepcopy(draft),
            tokenizer=tok,
        )

    return make


@pytest.fixture(scope="session")
def ray_session():
    """One in-process Ray for the whole run, with two fake GPUs for placement."""
    import ray

    if not ray.is_initialized():
        # The hook registers the toy method of tests/failing_method.py in the actors asked to
        # (it runs before Ray puts the driver's directory on a worker's path: PYTHONPATH does).
        # The driver's own PYTHONPATH comes first, so workers import the code the driver imports.
        path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), TESTS_PATH) if p)
        # address="local": always a fresh in-process cluster, never one that another process
        # started on this machine (ray.init() alone joins the latest `ray start` cluster, or fails
        # on the stale address a stopped one left in /tmp/ray).
        # CPUs are scheduling tokens here: the session's shared servers hold their shares for
        # good, and every test's own coordinator must still be placed (idle workers are not
        # prestarted for them: a process each).
        ray.init(address="local", num_cpus=32, num_gpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": "tests.worker_hook.register",
                              "env_vars": {"PYTHONPATH": path}},
                 _system_config={"prestart_worker_first_driver": False})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tiny_pair):
    """The tiny pair saved as Hugging Face checkpoint dirs (for actors, jobs, serve)."""
    root = tmp_path_factory.mktemp("tiny")
    target, draft = tiny_pair
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return {"target": str(root / "target"), "draft": str(root / "draft")}


@pytest.fixture(scope="session")
def tiny_tok(tiny_checkpoints, tmp_path_factory) -> dict:
    """The tiny checkpoints plus a character tokenizer folder of their own (serve tests)."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    save_char_tokenizer(path)
    return {**tiny_checkpoints, "tokenizer": str(path)}


@pytest.fixture(scope="session")
def char_tokenizer(tiny_tok):
    """The tiny models' character tokenizer, loaded (token id i is ALPHABET[i])."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tok["tokenizer"])


@pytest.fixture(scope="session")
def target(tiny_pair):
    """The tiny target model (tests copy it before handing it to an engine)."""
    return tiny_pair[0]


@pytest.fixture(scope="session")
def references(tiny_pair):
    """HF greedy continuations of the tiny target for ``ragged_prompts(8)`` (``GREEDY``)."""
    from tests.test_engine import GREEDY, ragged_prompts

    return [hf_greedy(tiny_pair[0], p, GREEDY.max_tokens) for p in ragged_prompts(8)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
