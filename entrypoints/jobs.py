"""Batch generation as a Ray job: JSONL prompts in, JSONL completions out, resumable.

    ray job submit -- python -m specray.entrypoints.jobs --input prompts.jsonl --output out.jsonl \\
        [--config specray.yaml] [--batch-size 64]

Input: one JSON object per line (blank lines are ignored)::

    {"id": "a", "prompt": "def fib(n):", "sampling": {"max_tokens": 64, "temperature": 0},
     "speculation": {"method": "draft", "num_speculative_tokens": 4}}
    {"prompt": [1, 2, 3]}

``prompt`` is a string or a list of token ids; ``sampling`` holds ``SamplingParams``
fields (default: ``SamplingParams()``), ``speculation`` the options of its ``method``
(default: the config's ``default_speculation``), checked by the method's own ``validate``. Every line is validated before anything
is generated; bad lines are reported with their line numbers (exit code 2).

OpenAI's batch file format is read too (``{"custom_id", "method": "POST", "url":
"/v1/completions" or "/v1/chat/completions", "body": {...}}`` per line, as OpenAI's Batch
API and vLLM's ``run-batch`` read it), told apart by the file's first line, and answered in
OpenAI's output format, resumed by ``custom_id``: see ``entrypoints/openai_batch.py``.

Output: one JSON object per input record, in input order::

    {"index": 0, "id": "a", "text": ..., "token_ids": [...], "finish_reason": "length", "metrics": {...}}

``index`` counts records (non-blank input lines) from 0. The file is flushed after each
batch; if it already exists, its lines are kept and only the missing records are
generated (a truncated last line, left by a crash, is dropped and rewritten), so running
the same command twice neither redoes nor duplicates work. A summary of this run is
printed to stdout as one JSON line and written to ``<output>.metrics.json``.

Ray: with ``--address`` or ``$RAY_ADDRESS`` (set by ``ray job submit``) the job joins
that cluster (``--address auto`` finds a running one); otherwise it starts a local one.
An already-initialized Ray (a test, a notebook) is used as is.

Exit codes: 0 done, 2 bad arguments/config/input/output file, 1 generation failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from specray.actors.config import SpecrayConfig
from specray.engine.argparsing import SuggestingParser
from specray.entrypoints import openai_batch
from specray.engine.checkpoints import checkpoint_problems, problems_line
from specray.entrypoints.defaults import with_demo_pair
from specray.entrypoints.processes import descendants, reap
from specray.engine.metrics import SpecMetrics
from specray.engine.params import SamplingParams, Speculation, best_speculation
from specray.policies.registry import Limits, parse_speculation, validate_speculation
from specray.protocol import openai as P

log = logging.getLogger("specray.jobs")

MAX_REPORTED_ERRORS = 20


class UsageError(Exception):
    """Bad arguments, config, input or output file: exit code 2, nothing generated."""


class JobLine(BaseModel):
    """One input record."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[StrictInt] = Field(..., description="Text, or token ids.")
    id: str | StrictInt | None = Field(None, description="Copied to the output line.")
    sampling: SamplingParams | None = None
    speculation: Speculation | None = None

    def requests(self) -> list[tuple]:
        """(prompt, sampling, speculation) as ``Coordinator.generate`` takes them (one here)."""
        return [(self.prompt, self.sampling.model_dump() if self.sampling else None,
                 self.speculation.model_dump() if self.speculation else None)]


# -- config and input ----------------------------------------------------------------------
def load_config(path: str | None) -> SpecrayConfig:
    """A SpecrayConfig from a YAML or JSON file; SpecrayConfig() (the demo pair) without one."""
    if path is None:
        return SpecrayConfig()
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config {path}: {exc}") from None
    try:
        import yaml

        data = json.loads(raw) if path.endswith(".json") else yaml.safe_load(raw)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise UsageError(f"config {path} does not parse: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise UsageError(f"config {path} must hold a mapping of option names to values")
    try:
        return SpecrayConfig.model_validate(engine_part(data or {}))
    except (ValidationError, ValueError) as exc:
        errors = _format_errors(exc, indent="  ") if isinstance(exc, ValidationError) else f"  {exc}"
        raise UsageError(f"config {path} is invalid:\n{errors}") from None


def engine_part(data: dict) -> dict:
    """A job's config is a SpecrayConfig; a serve config works too (vLLM's flat names such as
    ``max-model-len`` and ``speculative-config``, or ServeConfig's nested layout): its engine
    part is used, its server settings (port, API key, ...) do not apply to a job."""
    from specray.serve.config import ServeConfig, flat_to_nested

    nested = flat_to_nested(data)
    server = set(ServeConfig.model_fields) - {"engine"}
    return {**{k: v for k, v in nested.items() if k not in server and k != "engine"}, **nested.get("engine", {})}


def tool_settings(args: argparse.Namespace) -> str | None:
    """Auto tool choice's parser, from --config (a serve config's ``enable-auto-tool-choice`` and
    ``tool-call-parser``) and the flags, which override it; None where it is off."""
    from specray.entrypoints.flags import one_line
    from specray.serve.config import ServeConfig

    keys = ("enable_auto_tool_choice", "tool_call_parser")
    data = {}
    if args.config is not None:
        import yaml

        raw = yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {}  # load_config read it first
        data = {k.replace("-", "_"): v for k, v in raw.items() if k.replace("-", "_") in keys}
    data.update({k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    try:
        return ServeConfig.model_validate(data).auto_tool_parser()
    except ValidationError as exc:
        raise UsageError(one_line(exc)) from None


def _format_errors(exc: ValidationError, indent: str = "") -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"{indent}{loc}: {err['msg']}")
    return "\n".join(lines)


def _model_facts(config: SpecrayConfig) -> tuple[int | None, bool | None]:
    """(vocab size, has a tokenizer) of a local target checkpoint; None where unknown."""
    if config.target is None or not os.path.isdir(config.target):
        return None, None
    vocab = None
    try:
        cfg = json.loads((Path(config.target) / "config.json").read_text())
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    except (OSError, ValueError):
        pass
    tok_dir = config.tokenizer or config.target
    has_tok = None
    if os.path.isdir(tok_dir):
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        has_tok = any(os.path.exists(os.path.join(tok_dir, n)) for n in names)
    return vocab, has_tok


def read_input(path: str, config: SpecrayConfig,
               tool_parser: str | None = None) -> list[JobLine] | list[openai_batch.BatchRequest]:
    """Parse and validate every line; UsageError listing all bad lines (1-based numbers).

    The file's first JSON object decides its format: OpenAI's batch lines, or specray's.
    ``tool_parser``: auto tool choice's parser (``tool_settings``), None where it is off.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read input {path}: {exc}") from None
    objects, problems = [], []  # (line number, object) and (line number, message)
    # split on newlines only: str.splitlines() would also break at U+2028 etc. inside strings
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append((lineno, f"invalid JSON: {exc}"))
            continue
        if not isinstance(obj, dict):
            problems.append((lineno, f"expected a JSON object, got {type(obj).__name__}"))
            continue
        objects.append((lineno, obj))
    if objects and openai_batch.is_batch_line(objects[0][1]):
        records, bad = _read_batch_lines(objects, config, tool_parser)
    else:
        records, bad = _read_job_lines(objects, config)
    found = sorted(problems + bad, key=lambda e: e[0])
    errors = [f"line {n}: {msg}" for n, msg in found]
    if errors:
        # the cap counts lines, not problems: one line may have several
        bad_lines = sorted({n for n, _ in found})
        kept = set(bad_lines[:MAX_REPORTED_ERRORS])
        shown = [e for (n, _), e in zip(found, errors) if n in kept]
        more = len(errors) - len(shown)
        lines = len(bad_lines)
        msg = f"{path}: {lines} bad input line(s), nothing generated:\n  " + "\n  ".join(shown)
        if more:
            msg += f"\n  ... and {more} more"
        raise UsageError(msg)
    return records


def _read_job_lines(objects, config: SpecrayConfig) -> tuple[list[JobLine], list[tuple[int, str]]]:
    """specray's own line format."""
    vocab, has_tokenizer = _model_facts(config)
    # What the workers would report, read from the files: context unknown here (the
    # coordinator checks prompt lengths), vocabulary from the target's config.
    limits = Limits(capacity=2**31, vocab_size=vocab or 2**31, methods=config.method_facts())
    records, errors = [], []
    for lineno, obj in objects:
        try:
            rec = JobLine.model_validate(obj)
        except ValidationError as exc:
            errors.extend((lineno, e) for e in _format_errors(exc).splitlines())
            # The fields that did parse are checked too, so a line's every problem is said at once.
            refused = {e["loc"][0] for e in exc.errors() if e["loc"]}
            if "speculation" not in refused and obj.get("speculation") is not None:
                try:
                    validate_speculation(parse_speculation(obj["speculation"]), limits)
                except ValueError as problem:
                    errors.append((lineno, f"speculation: {problem}"))
            continue
        problems = _check_record(rec, config, vocab, has_tokenizer, limits)
        if problems:
            errors.extend((lineno, problem) for problem in problems)
            continue
        records.append(rec)
    return records, errors


def _read_batch_lines(objects, config: SpecrayConfig, tool_parser: str | None = None):
    """OpenAI's batch format: each body checked as the HTTP server checks its request."""
    facts = _batch_facts(config, tool_parser)
    checked, errors = [], []
    for lineno, obj in objects:
        rec, problems = openai_batch.check_line(obj, facts)
        errors.extend((lineno, p) for p in problems)
        if rec is not None:
            checked.append((lineno, rec))
    errors.extend(openai_batch.check_unique(checked))
    return [rec for _, rec in checked], errors


def _batch_facts(config: SpecrayConfig, tool_parser: str | None = None) -> openai_batch.Facts:
    """Tokenizer (chat templates, token counts), context and vocabulary of the job's model, and
    auto tool choice's parser."""
    from specray.engine.config import load_tokenizer
    from specray.protocol.checks import facts_for

    config = with_demo_pair(config)  # the demo pair when no target is given, as the job runs
    try:
        return facts_for(config, load_tokenizer(config.tokenizer or config.target), tool_parser)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the target {config.target}: {exc}") from None


def _check_record(rec: JobLine, config, vocab, has_tokenizer, limits: Limits) -> list[str]:
    """Every problem of a line that parsed (its prompt's and its speculation's), none: []."""
    problems = []
    if not rec.prompt:
        problems.append("prompt: the prompt is empty")
    elif isinstance(rec.prompt, str) and has_tokenizer is False:
        problems.append(f"prompt: a text prompt needs a tokenizer and {config.tokenizer or config.target} has none; "
                        "pass token ids")
    elif not isinstance(rec.prompt, str) and vocab is not None and (min(rec.prompt) < 0 or max(rec.prompt) >= vocab):
        problems.append(f"prompt: token ids must lie in [0, {vocab})")
    try:
        validate_speculation(rec.speculation or config.default_speculation or best_speculation(limits.methods), limits)
    except ValueError as exc:
        problems.append(f"speculation: {exc}")
    constraint = rec.sampling.structured_outputs if rec.sampling is not None else None
    if constraint is not None:
        try:
            _grammars(config.tokenizer or config.target if has_tokenizer else None).source(constraint.kind,
                                                                                            constraint.value)
        except ValueError as exc:
            problems.append(f"sampling.structured_outputs: {exc}")
    return problems


@functools.lru_cache(maxsize=4)
def _grammars(tokenizer_dir: str | None):
    """Structured outputs' grammars for a job's tokenizer (one per job, its lines share it)."""
    from specray.engine.config import load_tokenizer
    from specray.engine.grammar import Grammars

    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    return Grammars(tokenizer, len(tokenizer) if tokenizer is not None else 0,
                    getattr(tokenizer, "eos_token_id", None))


# -- output and resume ----------------------------------------------------------------------
def recover_output(path: str, records: list[JobLine]) -> int:
    """Check the lines already in ``path``; drop a torn last line; return how many are done.

    The lines must be records 0..n-1 in order (what this job writes). A last line that
    does not parse (a crash mid-write) is cut off the file so it is generated again.
    """
    p = Path(path)
    if not p.exists():
        return 0
    data = p.read_bytes()
    done, offset, keep_bytes = 0, 0, 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        last = end < 0
        chunk = data[offset:] if last else data[offset:end]
        next_offset = len(data) if last else end + 1
        is_final = next_offset >= len(data) or not data[next_offset:].strip()
        lineno = done + 1
        try:
            obj = json.loads(chunk)
            if not isinstance(obj, dict) or not isinstance(obj.get("index"), int):
                raise ValueError("not an output record")
        except ValueError:
            if chunk.strip() == b"" and not is_final:
                raise UsageError(f"{path}: blank line {lineno} in the middle of the output file")
            if is_final or last:
                log.warning("%s: dropping a truncated last line (%d bytes); it will be regenerated",
                            path, len(data) - offset)
                break
            raise UsageError(f"{path}: line {lineno} is not a valid output record (corrupt file?); "
                             "fix or remove it, or use another --output") from None
        if last:  # parses but has no newline: a torn write could still look complete
            log.warning("%s: last line has no newline; regenerating it", path)
            break
        if obj["index"] != done:
            raise UsageError(f"{path}: line {lineno} has index {obj['index']}, expected {done}; "
                             "the file was not written by this job for this input")
        if done >= len(records):
            raise UsageError(f"{path}: has more records than the input ({len(records)}); wrong --input?")
        if obj.get("id") != records[done].id:
            raise UsageError(f"{path}: line {lineno} has id {obj.get('id')!r} but input record {done} "
                             f"has id {records[done].id!r}; the input changed? use another --output")
        done += 1
        offset = keep_bytes = next_offset
    if keep_bytes < len(data):
        with open(p, "r+b") as f:
            f.truncate(keep_bytes)
    return done


def pending_records(output: str, records: list) -> list[int]:
    """Indices of the records still to generate, after checking what ``output`` holds (and
    cutting a torn last line): a tail in input order for specray's format, the custom_ids
    not yet answered for OpenAI's."""
    if records and isinstance(records[0], openai_batch.BatchRequest):
        done = openai_batch.done_ids(output, records, UsageError)
        return [i for i, r in enumerate(records) if r.custom_id not in done]
    return list(range(recover_output(output, records), len(records)))


def _output_lines(index: int, rec, outs: list[dict]) -> str:
    if isinstance(rec, openai_batch.BatchRequest):
        return rec.output_line(outs)
    return output_line(index, rec, outs[0])


def output_line(index: int, rec: JobLine, out: dict) -> str:
    return json.dumps({
        "index": index,
        "id": rec.id,
        "text": out["text"],
        "token_ids": out["token_ids"],
        "finish_reason": out["finish_reason"],
        "method": P.ran_method(out),
        "metrics": out["metrics"],
    }) + "\n"


def _write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# -- Ray ------------------------------------------------------------------------------------
def _connect(address: str | None) -> bool:
    """Join or start Ray; True if this call initialized it (and should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address)
    else:  # never "auto" (nor ray.init()'s default, which joins the cluster `ray start` last left here)
        log.info("no Ray address given: starting a local Ray")
        ray.init(address="local")
    return True


def _stop_coordinator(coordinator, pgs_before: set[str]) -> None:
    """Kill the coordinator, its workers and its placement group.

    The placement group outlives a killed creator actor (it lives as long as the job), so
    in a Ray that outlives this call (a test, a notebook) it would keep its GPUs. Use the
    coordinator's ``shutdown()`` where it has one; else remove the placement groups of
    this job created since the coordinator was.
    """
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    from specray.actors.coordinator import CoordinatorCore

    clean = False
    if hasattr(CoordinatorCore, "shutdown"):
        try:
            ray.get(coordinator.shutdown.remote(), timeout=60)
            clean = True
        except Exception as exc:  # dead already, or stuck: kill it below
            log.warning("coordinator shutdown failed: %s", exc)
    ray.kill(coordinator)
    if clean:
        return
    job = ray.get_runtime_context().get_job_id()
    for pg_id, info in ray.util.placement_group_table().items():
        if pg_id not in pgs_before and pg_id.endswith(job) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
            except Exception as exc:
                log.warning("could not remove placement group %s: %s", pg_id, exc)


# -- main -----------------------------------------------------------------------------------
def build_parser(prog: str = "python -m specray.entrypoints.jobs") -> argparse.ArgumentParser:
    p = SuggestingParser(
        prog=prog,
        description="Resumable batch generation over a JSONL file with a specray Coordinator.",
    )
    p.add_argument("--input", required=True, metavar="FILE",
                   help="JSONL prompts (prompt, optional id, sampling, speculation), or OpenAI's batch format")
    p.add_argument("--output", required=True, metavar="FILE",
                   help="JSONL completions, in input order (resumed if it exists)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="SpecrayConfig as YAML or JSON (default: the demo pair)")
    from specray.entrypoints.flags import add_tool_flags

    add_tool_flags(p.add_argument_group("tool calls (OpenAI batch files; docs/tool-calling.md)"))
    p.add_argument("--batch-size", type=int, default=64, metavar="N",
                   help="records per coordinator.generate call (default 64)")
    p.add_argument("--address", default=None, metavar="ADDRESS",
                   help="Ray address (default: $RAY_ADDRESS, else a new local Ray; 'auto' = a running cluster)")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m specray.entrypoints.jobs") -> int:
    t_start = time.perf_counter()
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:  # argparse already printed the message
        return int(exc.code or 0)
    if not log.handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    try:
        if args.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
        config = load_config(args.config)
        problems = checkpoint_problems(with_demo_pair(config).engine_config())
        if problems:  # before Ray starts
            raise UsageError(problems_line(problems, flags=False))
        records = read_input(args.input, config, tool_settings(args))
        pending = pending_records(args.output, records)
    except UsageError as exc:
        print(f"specray.jobs: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = _run(args, config, records, pending, t_start)
    except UsageError as exc:
        print(f"specray.jobs: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        log.exception("generation failed")
        print(f"specray.jobs: error: generation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0


def _run(args, config: SpecrayConfig, records: list, pending: list[int], t_start: float) -> dict:
    done_before = len(records) - len(pending)
    log.info("%s: %d records, %d already in %s, %d to generate", args.input, len(records), done_before,
             args.output, len(pending))
    earlier = Path(f"{args.output}.metrics.json")
    if not pending and earlier.is_file():  # a finished job run again: its summary is the run that generated
        log.info("nothing to generate: %s is complete; its summary stays in %s", args.output, earlier)
        try:
            return json.loads(earlier.read_text())
        except ValueError:
            log.warning("%s does not parse: writing a new summary", earlier)
    totals = SpecMetrics()
    finish: dict[str, int] = {}
    gen_seconds = startup_seconds = 0.0
    if pending:
        import ray
        from tqdm import tqdm

        from specray.actors.coordinator import Coordinator

        t0 = time.perf_counter()
        owns_ray = _connect(args.address)
        coordinator = None
        try:
            pgs_before = set(ray.util.placement_group_table())
            coordinator = Coordinator.remote(with_demo_pair(config).model_dump())
            ray.get(coordinator.ready.remote())
            # A batch has no first token to hurry: it starts once every drafter's worker is
            # constructed, instead of decoding plainly while one still loads.
            ray.get([w.__ray_ready__.remote() for w in ray.get(coordinator.workers.remote()).values()])
            startup_seconds = time.perf_counter() - t0
            log.info("coordinator ready in %.1f s", startup_seconds)
            batches = [pending[i:i + args.batch_size] for i in range(0, len(pending), args.batch_size)]
            t1 = time.perf_counter()
            with open(args.output, "a", encoding="utf-8") as out_file, tqdm(
                total=len(records), initial=done_before, file=sys.stderr, unit="prompt",
                desc="specray", mininterval=1.0, dynamic_ncols=False,
            ) as bar:
                for b, batch in enumerate(batches, start=1):
                    tb = time.perf_counter()
                    recs = [records[i] for i in batch]
                    calls = [r.requests() for r in recs]  # OpenAI bodies may ask for n choices
                    flat = [c for cs in calls for c in cs]
                    outs = ray.get(coordinator.generate.remote(*(list(part) for part in zip(*flat))))
                    starts = [0]
                    for cs in calls:
                        starts.append(starts[-1] + len(cs))
                    out_file.write("".join(_output_lines(i, r, outs[a:b])
                                           for i, r, a, b in zip(batch, recs, starts, starts[1:])))
                    out_file.flush()
                    os.fsync(out_file.fileno())
                    batch_tokens = 0
                    for o in outs:
                        totals.merge(SpecMetrics.from_dict(o["metrics"]))
                        finish[str(o["finish_reason"])] = finish.get(str(o["finish_reason"]), 0) + 1
                        batch_tokens += len(o["token_ids"])
                    dt = time.perf_counter() - tb
                    bar.update(len(batch))
                    log.info("batch %d/%d: records %d-%d, %d tokens in %.2f s (%.1f tok/s)", b, len(batches),
                             batch[0], batch[-1], batch_tokens, dt, batch_tokens / dt if dt > 0 else 0.0)
            gen_seconds = time.perf_counter() - t1
        finally:
            if coordinator is not None:
                _stop_coordinator(coordinator, pgs_before)
            if owns_ray:
                ours = descendants()
                ray.shutdown()
                reap(ours)
    wall = time.perf_counter() - t_start
    tokens = totals.num_generated_tokens
    summary = {
        "input": args.input,
        "output": args.output,
        "prompts_total": len(records),
        "prompts_skipped": done_before,
        "prompts_done": len(pending),
        "generated_tokens": tokens,
        "wall_seconds": round(wall, 3),
        "startup_seconds": round(startup_seconds, 3),
        "generation_seconds": round(gen_seconds, 3),
        # throughput of the generation itself (cluster and model start-up excluded)
        "tokens_per_second": round(tokens / gen_seconds, 2) if gen_seconds > 0 else 0.0,
        "mean_accepted_length": totals.mean_accepted_length,
        "acceptance_rate": totals.acceptance_rate,
        "num_drafts": totals.num_drafts,
        "num_draft_tokens": totals.num_draft_tokens,
        "num_accepted_tokens": totals.num_accepted_tokens,
        "accepted_per_pos": totals.accepted_per_pos,
        # per request, summed (one batched forward pass counts once for each of its rows)
        "target_forward_passes": totals.target_forward_passes,
        "finish_reasons": finish,
    }
    _write_json_atomic(f"{args.output}.metrics.json", summary)
    log.info("done: %d generated (%d skipped), %d tokens, %.1f tok/s; summary in %s.metrics.json",
             len(pending), done_before, tokens, summary["tokens_per_second"], args.output)
    return summary


if __name__ == "__main__":
    sys.exit(main())
