"""Building, caching and loading the demo pair.

The pair lives in ``<cache>/pair-v<version>-<recipe digest>-seed<seed>/`` with
``tokenizer/``, ``draft/`` and ``target/`` (ordinary Hugging Face folders) and
``metrics.json`` (alpha, c and how the pair was built).

The package ships the pair this recipe builds with seed 0 (``demo/weights/``, 4 MB, made by
``python -m specray.demo --force --ship``): a first run unpacks it into the cache in a second
instead of training for minutes. Its stamp is its ``metrics.json`` (recipe, seed, demo
version): a recipe that no longer matches it is built instead, never served from stale
weights. The key leaves out the Python version: a pair built here from another Python's
standard library (``--force``) is that recipe's pair too; ``metrics.json`` says which Python's
corpus trained it.

Why the care: tests, benchmarks and ``specray serve`` all call
:func:`load_or_build_demo_pair`, sometimes from several processes at once. A build takes
minutes, so a file lock makes the second caller wait and then load instead of training
again; and a build writes into a temporary folder that is renamed into place only when
complete, so an interrupted build never leaves a half pair that a later call would load.

Example::

    >>> pair = load_or_build_demo_pair()  # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(pair.target)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import tempfile
import time

import torch
import transformers

from .corpus import corpus_documents
from .metrics import MeasureConfig, held_out_loss, measure_alpha, measure_cost_ratio
from .prompts import held_out_prompts
from .tokenizer import CHAT_TEMPLATE, encode_documents, train_tokenizer
from .training import DemoRecipe, distill_draft, train_draft, train_target

log = logging.getLogger(__name__)

DEMO_VERSION = "2"
"""Bump when the build changes in a way the recipe digest does not capture."""
SHIPPED_DIR = pathlib.Path(__file__).parent / "weights"
"""The pair shipped with the package (seed 0, this recipe), unpacked on first use."""
CACHE_ENV = "SPECRAY_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/specray"
METRICS_FILE = "metrics.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where save_pretrained puts a tokenizer's chat template
PAIR_PARTS = {
    "tokenizer": ("tokenizer.json", "tokenizer_config.json"),
    "draft": ("config.json", "model.safetensors"),
    "target": ("config.json", "model.safetensors"),
}
"""Files each part must have for a cached pair to count as complete."""


@dataclasses.dataclass(frozen=True)
class DemoPair:
    """Paths of a trained demo pair and its measured quality.

    ``alpha``: greedy agreement of draft and target on held-out text; ``cost_ratio``:
    draft decode-step time over the target's (see :mod:`specray.demo.metrics`).
    """

    target: str
    draft: str
    tokenizer: str
    alpha: float
    cost_ratio: float

    def to_json(self) -> str:
        """One-line JSON with the five fields (what ``specray demo-models`` prints)."""
        return json.dumps(dataclasses.asdict(self))


def default_cache_dir() -> pathlib.Path:
    """``$SPECRAY_CACHE`` if set, else ``~/.cache/specray``."""
    return pathlib.Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def pair_key(seed: int, recipe: DemoRecipe) -> str:
    """Cache folder name: version, recipe digest and seed."""
    digest = hashlib.sha256(repr(dataclasses.astuple(recipe)).encode()).hexdigest()[:8]
    return f"pair-v{DEMO_VERSION}-{digest}-seed{seed}"


def shipped_pair(seed: int, recipe: DemoRecipe) -> pathlib.Path | None:
    """The shipped pair's folder when its stamp says this recipe and seed built it, else None."""
    stamp = SHIPPED_DIR / METRICS_FILE
    if not stamp.is_file():
        return None
    built = json.loads(stamp.read_text())
    same = (built.get("seed") == seed and built.get("recipe") == dataclasses.asdict(recipe)
            and built.get("versions", {}).get("demo") == DEMO_VERSION)
    return SHIPPED_DIR if same else None


def load_or_build_demo_pair(
    cache_dir: str | None = None, seed: int = 0, force: bool = False
) -> DemoPair:
    """Load the cached demo pair for ``seed``; on first use unpack the shipped pair (seed 0)
    or build it (a few CPU minutes); ``force`` builds it again. Safe to call from several
    processes at once."""
    recipe, measure = DemoRecipe(), MeasureConfig()
    root = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    key = pair_key(seed, recipe)
    final = root / key
    if not force and (pair := _load(final)) is not None:
        return pair
    with _file_lock(root / f"{key}.lock"):
        # Whoever held the lock before us may have just built it.
        if not force and (pair := _load(final)) is not None:
            return pair
        _remove_leftovers(root, key)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}.building-", dir=root))
        try:
            shipped = None if force else shipped_pair(seed, recipe)
            if shipped is not None:
                shutil.copytree(shipped, tmp, dirs_exist_ok=True)
                log.info("unpacked the demo pair shipped with specray into %s", final)
            else:
                build_demo_pair(tmp, seed, recipe, measure)
            tmp.chmod(0o755)  # mkdtemp made it private; the pair is for everyone
            if final.exists():  # forced rebuild, or an incomplete folder put there by hand
                final.rename(root / f".{key}.old-{os.getpid()}")
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_leftovers(root, key)
    pair = _load(final)
    if pair is None:
        raise RuntimeError(f"demo pair at {final} is incomplete right after building it")
    return pair


def build_demo_pair(
    out_dir: pathlib.Path, seed: int, recipe: DemoRecipe, measure: MeasureConfig
) -> dict:
    """Train tokenizer, draft and target into ``out_dir``, measure them, write
    ``metrics.json`` and return its contents. Deterministic weights for a given seed,
    corpus and thread count (``recipe.threads``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        return _build(out_dir, seed, recipe, measure)
    finally:
        torch.set_num_threads(threads)


def _build(out_dir: pathlib.Path, seed: int, recipe: DemoRecipe, measure: MeasureConfig) -> dict:
    start = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        phases[name] = round(time.perf_counter() - start - sum(phases.values()), 2)

    log.info("building the demo pair (seed %d) in %s", seed, out_dir)
    docs = corpus_documents("train")
    tokenizer = train_tokenizer((d.text for d in docs), recipe.vocab_size,
                                recipe.max_position_embeddings)
    tokenizer.save_pretrained(out_dir / "tokenizer")
    tokens = torch.tensor(encode_documents(tokenizer, [d.text for d in docs]))  # [n]
    log.info("corpus: %d training files, %d tokens", len(docs), tokens.numel())
    lap("tokenizer")

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    draft = train_draft(tokens, recipe, seed, eos, pad)
    lap("draft")
    target = train_target(draft, tokens, recipe, seed)
    target.save_pretrained(out_dir / "target")
    lap("target")
    distill_draft(draft, target, tokens, recipe, seed)
    draft.save_pretrained(out_dir / "draft")
    lap("distill")

    prompts = held_out_prompts(measure.alpha_prompts, str(out_dir / "tokenizer"), seed=seed)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    alpha = measure_alpha(target, draft, prompt_ids, measure.alpha_new_tokens)
    held_out = encode_documents(tokenizer, [d.text for d in corpus_documents("held_out")])
    c, draft_ms, target_ms = measure_cost_ratio(
        draft, target, held_out[: measure.cost_prompt_tokens], measure)
    losses = {name: round(held_out_loss(model, held_out[: measure.loss_tokens],
                                        measure.loss_window), 4)
              for name, model in (("draft", draft), ("target", target))}
    lap("measure")

    metrics = {
        "alpha": alpha,
        "cost_ratio": c,
        "draft_step_ms": draft_ms,
        "target_step_ms": target_ms,
        "held_out_loss": losses,
        "build_seconds": round(time.perf_counter() - start, 2),
        "phase_seconds": phases,
        "seed": seed,
        "train_tokens": tokens.numel(),
        "recipe": dataclasses.asdict(recipe),
        "measure": dataclasses.asdict(measure),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "demo": DEMO_VERSION},
    }
    (out_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    log.info("built the demo pair in %.1f s %s", metrics["build_seconds"], phases)
    _log_quality(metrics)
    return metrics


def _load(pair_dir: pathlib.Path) -> DemoPair | None:
    """The pair in ``pair_dir`` if it is complete, else None."""
    if not pair_dir.is_dir():
        return None
    missing = [f"{part}/{name}" for part, names in PAIR_PARTS.items() for name in names
               if not (pair_dir / part / name).is_file()]
    if missing or not (pair_dir / METRICS_FILE).is_file():
        log.warning("ignoring incomplete demo pair at %s (missing %s)", pair_dir,
                    missing or METRICS_FILE)
        return None
    metrics = json.loads((pair_dir / METRICS_FILE).read_text())
    _note_acceptance(pair_dir / "draft" / "config.json", float(metrics["alpha"]))
    _current_chat_template(pair_dir / "tokenizer" / CHAT_TEMPLATE_FILE)
    _log_quality(metrics, pair_dir)
    return DemoPair(
        target=str(pair_dir / "target"),
        draft=str(pair_dir / "draft"),
        tokenizer=str(pair_dir / "tokenizer"),
        alpha=float(metrics["alpha"]),
        cost_ratio=float(metrics["cost_ratio"]),
    )


ACCEPTANCE_KEY = "specray_acceptance"  # policies/checkpoint_files.py reads it (demo imports no specray)


def _note_acceptance(draft_config: pathlib.Path, alpha: float) -> None:
    """The draft's measured acceptance in its config.json, as specray's trained heads carry
    theirs: alpha, the chance each draft token is the target's, at every position (the
    self-tuning speculation length starts from it). Written once; a pair cached before this key
    existed gets it on its next load."""
    raw = json.loads(draft_config.read_text())
    if raw.get(ACCEPTANCE_KEY) == [round(alpha, 3)]:
        return
    raw[ACCEPTANCE_KEY] = [round(alpha, 3)]
    # (a read-only cache: the controller then starts from its own prior)
    _replace_text(draft_config, json.dumps(raw, indent=2), "note the draft's acceptance")


def _current_chat_template(path: pathlib.Path) -> None:
    """The chat template is code (``tokenizer.CHAT_TEMPLATE``), not something training made: a
    pair cached with an older one (before tools rendered) gets this one on its next load; the
    weights and the tokenizer's vocabulary stay as built."""
    if path.is_file() and path.read_text() == CHAT_TEMPLATE:
        return
    _replace_text(path, CHAT_TEMPLATE, "update the chat template")  # (a read-only cache keeps its own)


def _replace_text(path: pathlib.Path, text: str, what: str) -> None:
    """A cached pair's file rewritten aside and renamed (a reader never sees half of it); where
    the cache is read-only, a warning and the file as it was."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text)
        partial.replace(path)
    except OSError as exc:
        log.warning("could not %s in %s: %s", what, path, exc)


def _log_quality(metrics: dict, where: pathlib.Path | None = None) -> None:
    log.info("demo pair%s: alpha=%.3f, c=%.3f (decode step: draft %.2f ms, target %.2f ms;"
             " held-out loss: draft %s, target %s)",
             f" at {where}" if where else "", metrics["alpha"], metrics["cost_ratio"],
             metrics["draft_step_ms"], metrics["target_step_ms"],
             metrics["held_out_loss"]["draft"], metrics["held_out_loss"]["target"])


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    """Exclusive ``flock`` on ``path``; released when the process dies, so a killed
    build never leaves the lock held."""
    with open(path, "a") as fh:
        waited = time.perf_counter()
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the demo pair; waiting for %s", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
            log.info("waited %.0f s for the demo pair lock", time.perf_counter() - waited)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_leftovers(root: pathlib.Path, key: str) -> None:
    """Delete folders of interrupted builds and replaced pairs (caller holds the lock,
    so none of them belongs to a live build)."""
    for pattern in (f".{key}.building-*", f".{key}.old-*"):
        for path in root.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
