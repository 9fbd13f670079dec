"""Prometheus metrics through ``ray.util.metrics`` (exported by every Ray node).

Names follow vLLM's (``…spec_decode_num_drafts`` etc.); Ray prefixes them with
``ray_`` on export. ``GET /metrics`` gathers the ``specray_`` series from every node's
exporter, so the endpoint shows what a Prometheus scraping Ray would see.
"""

from __future__ import annotations

import urllib.request

PREFIX = "specray_"
LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class EngineMetrics:
    """Metrics one engine replica records (tagged by model)."""

    def __init__(self, model: str):
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = ("model",)
        self.tags = {"model": model}
        self.num_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Speculative drafts proposed.", tags)
        self.num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.", tags)
        self.num_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", tags)
        self.accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.", ("model", "position")
        )
        by_version = ("model", "version")
        self.drafts_by_version = Counter(PREFIX + "spec_decode_num_drafts_by_version",
                                         "Drafts, by the drafter version that made them (online learning).", by_version)
        self.accepted_by_version = Counter(PREFIX + "spec_decode_num_accepted_tokens_by_version",
                                           "Draft tokens accepted, by the drafter version that drafted them.", by_version)
        self.requests = Counter(PREFIX + "request_success", "Finished requests by finish reason.", ("model", "finished_reason"))
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", tags)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens.", tags)
        self.queue = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a batch slot.", tags)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch.", tags)
        # Paged KV (vLLM's names): how full the target's pool is, prompt tokens looked up in the
        # prefix cache and found there, requests preempted for want of blocks.
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Share of the target's KV blocks in use (0-1).", tags)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", tags)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", tags)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Requests preempted (KV freed, recomputed later).", tags)
        self._prefix_seen = (0, 0)  # the pool's prefix-cache totals at the last reading
        # The verification budget: steps it decided and the draft slots it admitted (their
        # ratio: slots verified per step; a falling one is the budget cutting drafts).
        self.budget_steps = Counter(PREFIX + "spec_decode_budget_steps", "Steps the verification budget decided.", tags)
        self.budget_slots = Counter(PREFIX + "spec_decode_budget_admitted_slots",
                                    "Draft slots the verification budget admitted.", tags)
        self._budget_seen = (0, 0)
        self.grammar_compile = Histogram(PREFIX + "structured_output_compile_seconds",
                                         "Time compiling a request's grammar (0 when cached).", LATENCY_BUCKETS, tags)
        self.grammar_mask = Counter(PREFIX + "structured_output_mask_seconds",
                                    "Time filling grammar masks, every scored position of constrained requests.", tags)
        self.grammar_cut = Counter(PREFIX + "structured_output_draft_tokens_cut",
                                   "Deterministic draft tokens a grammar refused, cut before verification.", tags)
        self.grammar_forced = Counter(PREFIX + "structured_output_forced_draft_tokens",
                                      "Tokens a grammar forced, drafted without a model (the grammar drafter).", tags)
        self.grammar_forced_accepted = Counter(PREFIX + "structured_output_forced_accepted_tokens",
                                               "Forced draft tokens the target accepted.", tags)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS, tags)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between streamed tokens.", LATENCY_BUCKETS, tags)

    def finished(self, output: dict, prompt_tokens: int, generated_tokens: int) -> None:
        """A request's last step delta (its metrics, its finish reason) and its token counts."""
        m, t = output["metrics"], self.tags
        if m["num_drafts"]:
            self.num_drafts.inc(m["num_drafts"], t)
            self.num_draft_tokens.inc(m["num_draft_tokens"], t)
        if m["num_accepted_tokens"]:
            self.num_accepted_tokens.inc(m["num_accepted_tokens"], t)
        for pos, n in enumerate(m["accepted_per_pos"]):
            if n:
                self.accepted_per_pos.inc(n, {**t, "position": str(pos)})
        for version, (drafts, accepted) in (m.get("accepted_by_version") or {}).items():
            if drafts:
                self.drafts_by_version.inc(drafts, {**t, "version": version})
            if accepted:
                self.accepted_by_version.inc(accepted, {**t, "version": version})
        if m.get("grammar_compile_s") is not None:
            self.grammar_compile.observe(m["grammar_compile_s"], t)
        if m.get("grammar_mask_s"):
            self.grammar_mask.inc(m["grammar_mask_s"], t)
        if m.get("grammar_cut_tokens"):
            self.grammar_cut.inc(m["grammar_cut_tokens"], t)
        if m.get("grammar_forced_tokens"):
            self.grammar_forced.inc(m["grammar_forced_tokens"], t)
        if m.get("grammar_forced_accepted"):
            self.grammar_forced_accepted.inc(m["grammar_forced_accepted"], t)
        if m.get("num_preemptions"):
            self.preemptions.inc(m["num_preemptions"], t)
        self.requests.inc(1, {**t, "finished_reason": output["finish_reason"] or "unknown"})
        if generated_tokens:
            self.generation_tokens.inc(generated_tokens, t)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens, t)

    def load(self, waiting: int, running: int, kv: dict | None = None, budget: dict | None = None) -> None:
        self.queue.set(waiting, self.tags)
        self.running.set(running, self.tags)
        if budget:  # totals since start: add what is new (a replaced worker starts from 0)
            seen = self._budget_seen
            steps, slots = budget["steps"], budget["slots"]
            if steps < seen[0]:
                seen = (0, 0)
            if steps > seen[0]:
                self.budget_steps.inc(steps - seen[0], self.tags)
            if slots > seen[1]:
                self.budget_slots.inc(slots - seen[1], self.tags)
            self._budget_seen = (steps, slots)
        if kv:
            self.kv_usage.set(kv["usage"], self.tags)
            # The pool's counts are totals since start: add what is new since the last reading.
            seen = self._prefix_seen
            if kv["prefix_queries"] > seen[0]:
                self.prefix_queries.inc(kv["prefix_queries"] - seen[0], self.tags)
            if kv["prefix_hits"] > seen[1]:
                self.prefix_hits.inc(kv["prefix_hits"] - seen[1], self.tags)
            self._prefix_seen = (max(kv["prefix_queries"], seen[0]), max(kv["prefix_hits"], seen[1]))


def scrape() -> str:
    """Prometheus text of every node's ``specray_`` series."""
    import ray

    lines: list[str] = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        try:
            body = urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{port}/metrics", timeout=5).read()
        except OSError:
            continue
        lines += [line for line in body.decode().splitlines() if PREFIX in line]
    return "\n".join(lines) + "\n"
