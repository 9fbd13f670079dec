"""The OpenAI-compatible HTTP ingress (FastAPI through ``@serve.ingress``)."""


import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from specray.engine.config import load_tokenizer
from specray.engine.scheduler import ContextLengthError, encode_prompt
from specray.serve import protocol as P
from specray.serve.config import ServeConfig
from specray.serve.metrics import scrape
from specray.serve.playground import SpeculationTrack, methods_listing, static_files

log = logging.getLogger(__name__)
app = FastAPI(title="specray", description="OpenAI-compatible speculative decoding server")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None):
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or None
    return (f"{field}: {err['msg']}" if field else err["msg"]), field


def _error_status(exc: Exception) -> HTTPError:
    """Map an engine-side exception (possibly wrapped by Ray) to an HTTP error."""
    from specray.actors.coordinator import WorkerLostError
    from specray.serve.engine import Overloaded

    cause = getattr(exc, "cause", None) or exc
    name = type(cause).__name__
    if isinstance(cause, Overloaded) or name in ("BackPressureError", "Overloaded"):
        return HTTPError(503, str(cause) or "server busy, retry later", "overloaded")
    if isinstance(cause, WorkerLostError):
        return HTTPError(503, f"{cause}; retry the request", "worker_lost")
    if isinstance(cause, ValueError):
        return HTTPError(400, str(cause).split("\n\n")[0].strip())
    log.exception("internal error", exc_info=exc)
    return HTTPError(500, f"internal error: {name}", "internal_error")


def _context_length(cfg: ServeConfig) -> int | None:
    """The engines' context, computed as they compute it (None without a target)."""
    engine = cfg.engine.engine_config()
    if engine.target is None:
        return None
    from transformers import AutoConfig

    return engine.context_length(AutoConfig.from_pretrained(engine.target))


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, config: dict):
        cfg = ServeConfig.model_validate(config)
        self.engine = engine
        self.model = cfg.model_name
        self.default_max_tokens = cfg.default_max_tokens
        self.api_key = cfg.resolved_api_key()
        self.tokenizer = load_tokenizer(cfg.engine.tokenizer or cfg.engine.target)
        self.context = _context_length(cfg)
        self.engine_config = cfg.engine
        self.static = static_files()

    # -- routes ----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self):
        return PlainTextResponse(await asyncio.to_thread(scrape), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(self, request: Request):
        return await self._guard(request, self._models)

    # The playground: a page (open to all, it asks for the key) over the API above.
    @app.get("/playground")
    async def playground(self):
        return self._static_file("playground.html")

    @app.get("/playground/static/{name}")
    async def playground_static(self, name: str):
        return self._static_file(name)

    @app.get("/playground/methods")
    async def playground_methods(self, request: Request):
        async def listing():
            methods = await asyncio.to_thread(methods_listing, self.engine_config)
            return {"model": self.model, "methods": methods}

        return await self._guard(request, listing)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._guard(request, lambda: self._generate(request, P.CompletionRequest, chat=False))

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._guard(request, lambda: self._generate(request, P.ChatCompletionRequest, chat=True))

    # -- plumbing ----------------------------------------------------------------------------
    async def _guard(self, request: Request, handler):
        try:
            self._authorize(request)
            return await handler()
        except HTTPError as e:
            return JSONResponse(P.error_body(e.message, e.kind, e.status, e.param), status_code=e.status)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise HTTPError(401, "missing or invalid API key (Authorization: Bearer ...)", "authentication_error")

    def _static_file(self, name: str):
        if name not in self.static:  # only the package's own files, by name
            return JSONResponse(P.error_body(f"no such file: {name}", "not_found_error", 404), status_code=404)
        body, media_type = self.static[name]
        return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def _models(self):
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "specray"}]}

    async def _parse(self, request: Request, model):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the JSON body must be an object")
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            message, field = _validation_message(e)
            raise HTTPError(400, message, param=field) from None
        if req.model != self.model:
            raise HTTPError(404, f"model {req.model!r} does not exist; this server serves {self.model!r}",
                            "invalid_request_error", param="model")
        return req

    def _prompt(self, req, chat: bool):
        if not chat:
            return req.prompt
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise HTTPError(400, "this model has no chat template; use /v1/completions")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _max_tokens(self, req, prompt, chat: bool) -> int:
        """max_tokens for a request that gives none, after refusing (400) one whose prompt +
        max_tokens exceeds the context, naming both numbers, as vLLM and OpenAI do.

        Without max_tokens, chat runs up to the context (OpenAI's chat default) and a
        completion gets ``default_max_tokens`` (OpenAI's 16), cut to the room the prompt leaves.
        Prompts that are themselves bad (too long, empty, no tokenizer) are the engine's to refuse.
        """
        if self.context is None:
            return self.default_max_tokens
        try:
            prompt_tokens = len(encode_prompt(prompt, self.tokenizer))
        except ValueError:
            return self.default_max_tokens
        if not 0 < prompt_tokens < self.context:
            return self.default_max_tokens
        try:
            return P.resolve_max_tokens(req, prompt_tokens, self.context, self.default_max_tokens, chat)
        except ContextLengthError as e:
            raise HTTPError(400, str(e), param=req.requested_max_tokens()[0]) from None

    async def _generate(self, request: Request, model, chat: bool):
        req = await self._parse(request, model)
        prompt = self._prompt(req, chat)
        default_max_tokens = self._max_tokens(req, prompt, chat)
        try:
            samplings = [req.sampling(default_max_tokens, i) for i in range(req.n)]
        except ValidationError as e:
            raise HTTPError(400, _validation_message(e)[0]) from None
        spec = req.speculation.model_dump() if req.speculation else None
        streams = [
            self.engine.options(stream=True).stream.remote(prompt, s.model_dump(), spec) for s in samplings
        ]
        rid = P.request_id("chatcmpl" if chat else "cmpl")
        max_stop = max((len(s) for s in samplings[0].stop), default=0)
        if req.stream:
            first = await self._first_items(streams)
            options = req.stream_options or P.StreamOptions()
            return StreamingResponse(
                self._sse(rid, streams, first, chat, max_stop, options.include_usage, options.include_speculation),
                media_type="text/event-stream",
            )
        finals = await asyncio.gather(*(self._last(s) for s in streams))
        choices = [P.choice(i, o["text"], P.finish_reason(o["finish_reason"]), chat) for i, o in enumerate(finals)]
        return P.completion_response(rid, self.model, choices, P.usage(finals), P.speculation_metrics(finals), chat)

    async def _last(self, stream):
        last = None
        try:
            async for out in stream:
                last = out
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP status
            raise _error_status(e) from None
        return last

    async def _first_items(self, streams) -> list:
        """Wait for each stream's first output, so errors become a status code, not a broken stream."""
        try:
            return list(await asyncio.gather(*(s.__anext__() for s in streams)))
        except Exception as e:  # noqa: BLE001
            for s in streams:
                s.cancel()
            raise _error_status(e) from None

    async def _sse(self, rid, streams, first, chat, max_stop, include_usage, include_speculation=False):
        queue: asyncio.Queue = asyncio.Queue()
        # With include_speculation each choice's steps travel with the text they make up.
        tracks = [SpeculationTrack(self.tokenizer) for _ in streams] if include_speculation else None

        async def pump(index, stream, head):
            try:
                await queue.put((index, head))
                if not head["finished"]:
                    async for out in stream:
                        await queue.put((index, out))
            except Exception as e:  # noqa: BLE001
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(i, s, h)) for i, (s, h) in enumerate(zip(streams, first))]
        sent = [0] * len(streams)
        finals: list = [None] * len(streams)
        try:
            if chat:
                roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(len(streams))]
                yield P.sse(P.chunk(rid, self.model, roles, chat))
            while any(f is None for f in finals):
                index, out = await queue.get()
                if isinstance(out, Exception):
                    err = _error_status(out)
                    yield P.sse(P.error_body(err.message, err.kind, err.status))
                    return
                text, steps = out["text"], None
                if tracks is not None:
                    upto, steps = tracks[index].advance(out, sent[index], max_stop)
                else:  # hold back a possible stop-string prefix until it is decided
                    upto = len(text) if out["finished"] or not max_stop else max(sent[index], len(text) - max_stop + 1)
                delta = text[sent[index]:upto]
                sent[index] = upto
                reason = P.finish_reason(out["finish_reason"]) if out["finished"] else None
                if delta or reason or steps:
                    choice = P.choice(index, delta, reason, chat, delta=True)
                    if steps is not None:
                        choice["speculation"] = steps
                    yield P.sse(P.chunk(rid, self.model, [choice], chat))
                if out["finished"]:
                    finals[index] = out
            if include_usage:
                yield P.sse(P.chunk(rid, self.model, [], chat, usage=P.usage(finals)))
            yield "data: [DONE]\n\n"
        finally:  # also on client disconnect: cancelling the streams frees the sequences
            for t in tasks:
                t.cancel()
            for s in streams:
                s.cancel()
