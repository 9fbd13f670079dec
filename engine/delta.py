"""What one step added to one request, and a request's whole output built back from that.

The engine hands actors a ``StepDelta`` per request that moved in a step; the engine
worker, the coordinator and the Serve deployment pass it on as it is (a dict, across
actors), so what crosses an actor per step stays proportional to what the step added, never
to the length of the output. Where a whole output is needed (a non-streamed response, a
job's record, the SSE text and events of one choice), the front end keeps one
``OutputAssembly`` per request and adds each delta to it, as vLLM's ``OutputProcessor``
keeps one state per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from specray.engine.request import RequestOutput


@dataclass(frozen=True)
class StepDelta:
    """One step of one request.

    text:     what this step added to the text (held back: an incomplete character)
    truncate: set only when a stop string that began in text already sent finished the
              request: the whole text is cut to this many characters (``text`` is then "")
    metrics:  the request's ``SpecMetrics`` dict, once, when it finishes
    """

    request_id: str
    new_token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    error: str | None = None  # finish_reason "error": what raised
    step: dict | None = None  # what this step's speculation did (``speculation_event``)
    logprobs: list[dict] | None = None  # the new tokens' (when asked)
    prompt_logprobs: list[dict | None] | None = None  # the prompt's, with the first tokens (when asked)
    metrics: dict | None = None
    truncate: int | None = None

    @classmethod
    def of(cls, out: RequestOutput, sent: int) -> "StepDelta":
        """The delta of an engine step's output, ``sent`` characters of its text sent before."""
        new = out.new_token_ids
        return cls(
            request_id=out.request_id,
            new_token_ids=list(new),
            text=out.text[sent:],
            finished=out.finished,
            finish_reason=out.finish_reason,
            error=out.error,
            step=out.step,
            logprobs=out.logprobs[len(out.logprobs) - len(new):] if out.logprobs is not None else None,
            prompt_logprobs=out.prompt_logprobs if len(out.token_ids) == len(new) else None,
            metrics=out.metrics if out.finished else None,
            truncate=len(out.text) if len(out.text) < sent else None,
        )

    def to_dict(self) -> dict:
        # A shallow copy of the fields: what it holds (the step event, token and logprob lists)
        # is made fresh for each delta and never changed after. ``asdict`` deep-copied every
        # nested value, once per row per step, in the engine worker's loop between two steps.
        return dict(self.__dict__)


class OutputAssembly:
    """A request's whole output (a ``RequestOutput`` dict) from its deltas, added in order.

        whole = OutputAssembly(rid, prompt_ids)
        for delta in stream:
            out = whole.add(delta)   # out["text"], out["token_ids"], ... so far
    """

    def __init__(self, request_id: str = "", prompt_token_ids=()):
        self.whole = {"request_id": request_id, "prompt_token_ids": list(prompt_token_ids), "token_ids": [],
                      "new_token_ids": [], "text": "", "finished": False, "finish_reason": None, "metrics": {},
                      "step": None, "error": None, "logprobs": None, "prompt_logprobs": None}

    def add(self, delta: dict) -> dict:
        """Add one delta; returns the whole output so far (the same dict each time)."""
        w = self.whole
        w["request_id"] = delta["request_id"]
        w["token_ids"].extend(delta["new_token_ids"])
        w["new_token_ids"] = list(delta["new_token_ids"])
        if delta.get("truncate") is not None:
            w["text"] = w["text"][:delta["truncate"]]
        w["text"] += delta["text"]
        for key in ("finished", "finish_reason", "error", "step"):
            w[key] = delta[key]
        if delta.get("metrics") is not None:
            w["metrics"] = delta["metrics"]
        if delta.get("logprobs") is not None:
            w["logprobs"] = w["logprobs"] if w["logprobs"] is not None else []
            w["logprobs"].extend(delta["logprobs"])
        if delta.get("prompt_logprobs") is not None:
            w["prompt_logprobs"] = delta["prompt_logprobs"]
        return w
