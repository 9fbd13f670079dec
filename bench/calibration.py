"""DSpark's draft slots on the demo pair: per position, how often the engine accepts a slot given
the one before it, with the Markov head and without it (the same backbone's own drafts), and
the confidence head's estimates against what was measured (a table and a reliability plot).

Used by ``bench/block.py`` (``--dspark DIR``). A slot j is *reached* when slots 1 .. j - 1 were
accepted; its measured acceptance is accepted / reached, and its estimate the mean of the
confidence head's values over the rows that reached it.
"""

from __future__ import annotations

from collections import defaultdict

RELIABILITY_BINS = 10


class SlotLog:
    """Wraps a proposer's ``propose`` and ``commit``: each drafted row's estimates, then how
    many of its slots were accepted."""

    def __init__(self, proposer):
        self.proposer, self.pending, self.rows = proposer, {}, []  # rows: (confidence or None, size, accepted)
        propose, on_device, commit = proposer.propose, proposer.propose_on_device, proposer.commit

        def logged(draw):
            def call(rows):
                draft = draw(rows)
                for r, d in zip(rows, draft.rows if draft is not None else ()):
                    self.pending[r.slot] = (d.confidence, d.size)
                return draft
            return call

        def logged_commit(rows):
            for c in rows:
                if c.slot in self.pending:
                    confidence, size = self.pending.pop(c.slot)
                    if size:
                        self.rows.append((confidence, size, c.num_accepted))
            return commit(rows)

        proposer.propose, proposer.propose_on_device, proposer.commit = logged(propose), logged(on_device), logged_commit

    def close(self) -> None:
        for name in ("propose", "propose_on_device", "commit"):
            self.proposer.__dict__.pop(name, None)

    def per_position(self) -> list[dict]:
        """Per slot: reached, accepted, measured acceptance and mean estimate."""
        reached, accepted, estimate = defaultdict(int), defaultdict(int), defaultdict(float)
        for confidence, size, got in self.rows:
            for j in range(min(size, got + 1)):
                reached[j] += 1
                accepted[j] += j < got
                estimate[j] += confidence[j] if confidence is not None else 0.0
        with_estimates = any(c is not None for c, _, _ in self.rows)
        return [{"position": j + 1, "reached": reached[j], "measured": round(accepted[j] / reached[j], 3),
                 "predicted": round(estimate[j] / reached[j], 3) if with_estimates else None}
                for j in sorted(reached)]

    def reliability(self, bins: int = RELIABILITY_BINS) -> list[dict]:
        """Every reached slot binned by its estimate: the bin's mean estimate against its measured acceptance."""
        count, hits, total = [0] * bins, [0] * bins, [0.0] * bins
        for confidence, size, got in self.rows:
            if confidence is None:
                continue
            for j in range(min(size, got + 1)):
                b = min(int(confidence[j] * bins), bins - 1)
                count[b] += 1
                hits[b] += j < got
                total[b] += confidence[j]
        return [{"bin": f"{b / bins:.1f}-{(b + 1) / bins:.1f}", "slots": count[b],
                 "predicted": round(total[b] / count[b], 3), "measured": round(hits[b] / count[b], 3)}
                for b in range(bins) if count[b]]


def measure_slots(engine, prompts, sampling, speculation) -> dict:
    """Greedy DSpark runs on ``prompts`` with its heads and with the backbone alone: per-position
    acceptance of both, and the confidence head's calibration."""
    from specray.training.dspark import backbone_only

    proposer = engine.proposers.get("dspark")
    out = {}
    for name in ("markov", "backbone"):
        log = SlotLog(proposer)
        try:
            if name == "backbone":
                with backbone_only(proposer.drafter):
                    engine.generate(prompts, sampling, speculation)
            else:
                engine.generate(prompts, sampling, speculation)
        finally:
            log.close()
        rows = log.per_position()
        out[name] = {"per_position": rows, "mean_accepted_length": round(
            1 + sum(got for _, _, got in log.rows) / max(len(log.rows), 1), 3)}
        if name == "markov":
            out["reliability"] = log.reliability()
    return out


def lines(slots: dict) -> list[str]:
    """The per-position table: acceptance with and without the Markov head, the estimates."""
    mine, plain = slots["markov"]["per_position"], {r["position"]: r for r in slots["backbone"]["per_position"]}
    out = ["", "DSpark per position (greedy; acceptance given the position before was accepted):",
           f"{'pos':>4} {'reached':>8} {'markov':>8} {'no markov':>10} {'predicted':>10}"]
    for r in mine:
        other = plain.get(r["position"])
        out.append(f"{r['position']:>4} {r['reached']:>8} {r['measured']:>8.3f} "
                   f"{(other['measured'] if other else float('nan')):>10.3f} "
                   f"{(r['predicted'] if r['predicted'] is not None else float('nan')):>10.3f}")
    out.append(f"mean accepted length: with the Markov head {slots['markov']['mean_accepted_length']:.3f}, "
               f"the backbone alone {slots['backbone']['mean_accepted_length']:.3f}")
    out += ["confidence calibration (reached slots binned by estimate):",
            f"{'bin':>8} {'slots':>6} {'predicted':>10} {'measured':>9}"]
    out += [f"{r['bin']:>8} {r['slots']:>6} {r['predicted']:>10.3f} {r['measured']:>9.3f}" for r in slots["reliability"]]
    return out


def plot(slots: dict, path) -> None:
    """Per-position acceptance (with and without the Markov head, the estimates) and the reliability diagram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, label in (("markov", "with Markov head"), ("backbone", "backbone alone")):
        rows = slots[name]["per_position"]
        left.plot([r["position"] for r in rows], [r["measured"] for r in rows], marker="o", label=label)
    rows = slots["markov"]["per_position"]
    if rows and rows[0]["predicted"] is not None:
        left.plot([r["position"] for r in rows], [r["predicted"] for r in rows], "k--", marker="x",
                  label="confidence head (predicted)")
    left.set(xlabel="draft position", ylabel="acceptance given the previous", title="DSpark per position", ylim=(0, 1))
    left.legend()
    rel = slots["reliability"]
    right.plot([0, 1], [0, 1], "k:", label="perfect")
    right.scatter([r["predicted"] for r in rel], [r["measured"] for r in rel], s=[10 + r["slots"] / 4 for r in rel],
                  label="bins (size: slots)")
    right.set(xlabel="predicted acceptance", ylabel="measured acceptance", title="confidence head reliability",
              xlim=(0, 1), ylim=(0, 1))
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
