"""The OpenAI-compatible HTTP ingress (FastAPI through ``@serve.ingress``)."""


import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from specray.engine.config import load_tokenizer
from specray.engine.admission import RETRY_AFTER_S, RequestCost
from specray.engine.delta import OutputAssembly
from specray.protocol import checks as C
from specray.protocol import openai as P
from specray.protocol import tools
from specray.serve.config import ServeConfig
from specray.serve.deployment import REFUSED
from specray.serve.metrics import scrape
from specray.serve.playground import SpeculationTrack, methods_listing, static_files

log = logging.getLogger(__name__)
app = FastAPI(title="specray", description="OpenAI-compatible speculative decoding server")
SHUTTING_DOWN = "shutting_down"  # the error type of requests refused or ended by a draining server
MAX_BODY_BYTES = 32 * 2**20  # a request larger than this is refused (413) before it is parsed
_KINDS = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error"}


# Routing errors (unknown path, wrong HTTP method) answer in OpenAI's shape too, not FastAPI's
# {"detail": ...}; the path or method is the param at fault.
@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException):
    param = "method" if exc.status_code == 405 else "path" if exc.status_code == 404 else None
    detail = exc.detail if isinstance(exc.detail, str) else "request refused"
    if exc.status_code == 404:
        detail = f"no such endpoint: {request.url.path}"
    elif exc.status_code == 405:
        detail = f"{request.method} is not allowed on {request.url.path}"
    _log_client_error(exc.status_code, request.url.path, detail)
    return JSONResponse(P.error_body(detail, _KINDS.get(exc.status_code, "invalid_request_error"), exc.status_code,
                                     param), status_code=exc.status_code, headers=getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_exception(request: Request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    message = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
    _log_client_error(400, request.url.path, message)
    return JSONResponse(P.error_body(message, "invalid_request_error", 400, param), status_code=400)


# Under "ray.serve", so the replica's log (with its request ids) carries these lines.
client_log = logging.getLogger("ray.serve.specray.clients")
client_log.setLevel(logging.INFO)


def _log_client_error(status: int, path: str, message: str) -> None:
    """A client's mistake is one line in the log, never a traceback."""
    client_log.info("client error %d on %s: %s", status, path, " ".join(message.split())[:500])


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None,
                 retry_after_s: float | None = None):
        self.status, self.message, self.kind, self.param = status, message, kind, param
        # A 503 is transient: it says when to come back (seconds, as HTTP's Retry-After).
        self.headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None


def _error_status(exc: Exception) -> HTTPError:
    """Map an engine-side exception (possibly wrapped by Ray) to an HTTP error."""
    from specray.actors.coordinator import WorkerLostError

    if isinstance(exc, dict) and REFUSED in exc:  # the engine refused the request (serve/deployment.py: client_error)
        e = exc[REFUSED]
        return HTTPError(e["status"], e["message"], e["kind"], e["param"], e.get("retry_after_s"))
    if isinstance(exc, dict):  # the engine failed this request alone (finish_reason "error"): it goes on serving
        log.error("request %s failed: %s", exc.get("request_id"), exc.get("error"))
        return HTTPError(500, f"internal error: {exc.get('error') or 'the request failed'}", "internal_error")
    cause = getattr(exc, "cause", None) or exc
    name = type(cause).__name__
    if name == "BackPressureError":  # Serve's own queue bound (one call per request: nothing of it ran)
        return HTTPError(503, str(cause) or "server busy, retry later", "overloaded", retry_after_s=RETRY_AFTER_S)
    if isinstance(cause, WorkerLostError):
        return HTTPError(503, f"{cause}; retry the request", "worker_lost")
    if isinstance(cause, ValueError):
        return HTTPError(400, str(cause).split("\n\n")[0].strip(), param=getattr(cause, "param", None))
    log.exception("internal error", exc_info=exc)
    return HTTPError(500, f"internal error: {name}", "internal_error")


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, config: dict):
        cfg = ServeConfig.model_validate(config)
        self.engine = engine
        self.model = cfg.model_name
        self.default_max_tokens = cfg.default_max_tokens
        self.admission = cfg.admission_policy()  # its load-free part: a request over the limits never leaves here
        self.api_key = cfg.resolved_api_key()
        engine = cfg.engine  # resolved by the application builder (entrypoints/app.py)
        self.tokenizer = load_tokenizer(engine.tokenizer or engine.target)
        # What checking a request needs (context, vocabulary, methods), read once, as the engines see it.
        self.facts = C.facts_for(engine, self.tokenizer, cfg.auto_tool_parser())
        self.token_text = P.token_text_of(self.tokenizer)
        self.engine_config = engine
        self.static = static_files()
        # Draining (specray serve on SIGINT/SIGTERM): new requests get 503; the streams of the
        # requests in flight are kept here so that what the grace period leaves is ended.
        self._draining = False
        self._expired = False
        self._streams: set = set()

    # -- routes ----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        if self._draining:  # a load balancer stops sending requests here
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    # -- draining (called through the application's handle, not over HTTP) ---------------------
    async def drain(self) -> None:
        """Take no new requests (503); those in flight go on."""
        self._draining = True

    async def in_flight(self) -> int:
        return len(self._streams)

    async def expire(self) -> int:
        """End the requests still in flight: each gets a final error (503, its stream an error
        event); their sequences are aborted. Returns how many there were."""
        self._expired = True
        streams = list(self._streams)
        for stream in streams:
            stream.cancel()
        return len(streams)

    @app.get("/metrics")
    async def metrics(self):
        return PlainTextResponse(await asyncio.to_thread(scrape), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(self, request: Request):
        return await self._guard(request, self._models)

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):  # the openai client's models.retrieve
        async def card():
            if model_id != self.model:
                raise HTTPError(404, f"The model {model_id!r} does not exist; this server serves {self.model!r}",
                                param="model")
            return self._card()

        return await self._guard(request, card)

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
            return {"model": self.model, "methods": methods,
                    "online_learning": self.engine_config.online_learning.enabled}

        return await self._guard(request, listing)

    # The speculation-length policy (docs/speculation-length.md): the verification budget's cost
    # table, calibrations, last decision and totals, in the replica that answers.
    @app.get("/v1/speculation")
    async def speculation(self, request: Request):
        return await self._guard(request, lambda: self.engine.speculation.remote())

    # Online learning (docs/online-learning.md): drafter versions, loads, the learning switch.
    @app.get("/v1/drafters")
    async def drafters_status(self, request: Request):
        return await self._guard(request, lambda: self._drafters("status", {}))

    @app.post("/v1/drafters/{action}")
    async def drafters(self, action: str, request: Request):
        async def run():
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise HTTPError(400, "the body must be a JSON object") from None
            if not isinstance(body, dict):
                raise HTTPError(400, "the body must be a JSON object")
            return await self._drafters(action, body)

        return await self._guard(request, run)

    async def _drafters(self, action: str, body: dict):
        if not self.engine_config.online_learning.enabled:  # answered here: no engine call, no traceback
            raise HTTPError(404, "online learning is off on this server: start it with --online-learning "
                                 "(online_learning.enabled; online_learning.learn: false only loads versions)",
                            "not_found_error")
        try:
            return await self.engine.drafters.remote(action, body)
        except Exception as exc:  # noqa: BLE001 - a bad action or argument is the client's: 400
            cause = exc
            while getattr(cause, "cause", None) is not None:  # raised in a worker, passed on by the coordinator
                cause = cause.cause
            if isinstance(cause, ValueError):
                raise HTTPError(400, str(cause).split("\n\n")[0], param=getattr(cause, "param", None)) from None
            raise

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._guard(request, lambda: self._generate(request, chat=False))

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._guard(request, lambda: self._generate(request, chat=True))

    # -- plumbing ----------------------------------------------------------------------------
    async def _guard(self, request: Request, handler):
        try:
            self._authorize(request)
            return await handler()
        except HTTPError as e:
            if e.status < 500:
                _log_client_error(e.status, request.url.path, e.message)
            return JSONResponse(P.error_body(e.message, e.kind, e.status, e.param), status_code=e.status,
                                headers=e.headers)

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
        return {"object": "list", "data": [self._card()]}

    def _card(self) -> dict:  # OpenAI's model object, with vLLM's max_model_len (tools size requests by it)
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "specray",
                "max_model_len": self.facts.context}

    async def _parse(self, request: Request, chat: bool):
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise HTTPError(413, f"the body has {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"malformed JSON body: {e}") from None
        except RecursionError:
            raise HTTPError(400, "malformed JSON body: nested too deeply") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the JSON body must be an object")
        try:
            req = C.parse(body, chat, facts=self.facts)
        except C.RequestError as e:
            raise HTTPError(400, str(e), param=e.param) from None
        except RecursionError:  # a field nested thousands of levels deep
            raise HTTPError(400, "a field of the body is nested too deeply") from None
        if req.model != self.model:
            raise HTTPError(404, f"model {req.model!r} does not exist; this server serves {self.model!r}",
                            "invalid_request_error", param="model")
        return req

    async def _generate(self, request: Request, chat: bool):
        if self._draining:
            raise HTTPError(503, "the server is shutting down; retry elsewhere", SHUTTING_DOWN,
                            retry_after_s=RETRY_AFTER_S)
        req = await self._parse(request, chat)
        try:
            if req.constraint() is not None:  # compiling a grammar (bounded by llguidance's limits) off the loop
                checked = await asyncio.to_thread(C.check, req, chat, self.facts, self.default_max_tokens)
            else:
                checked = C.check(req, chat, self.facts, self.default_max_tokens)
        except C.RequestError as e:
            raise HTTPError(400, str(e), param=e.param) from None
        # The whole request is one call: the engine replica admits it whole or refuses it whole.
        count = sum(len(choices) for choices in checked.samplings)
        param = "n" if len(checked.prompt_ids) == 1 else "prompt"
        decision = self.admission.check(RequestCost(count), param)
        if not decision.admitted:
            raise HTTPError(decision.status, decision.message, decision.kind, decision.param)
        stream = self.engine.options(stream=True).run.remote(
            checked.prompt_ids, [[s.model_dump() for s in choices] for choices in checked.samplings],
            checked.speculation, param)
        self._streams.add(stream)
        try:
            return await self._respond(req, checked, chat, stream, count)
        finally:
            if not req.stream:  # a stream is in flight until its last event (_sse)
                self._streams.discard(stream)

    async def _respond(self, req, checked, chat: bool, stream, count: int):
        # What each choice echoes (completions with echo): its prompt's text.
        echo = req.echo_prompt()
        echoes = [P.echo_of(checked.prompts[i // req.n], checked.prompt_ids[i // req.n], self.tokenizer) if echo
                  else None for i in range(count)]
        rid = P.request_id("chatcmpl" if chat else "cmpl")
        max_stop = max((len(s) for s in checked.samplings[0][0].stop), default=0)
        if req.stream:
            first = await self._first_item(stream)
            options = req.stream_options or P.StreamOptions()
            return StreamingResponse(
                self._sse(rid, stream, count, first, chat, max_stop, options, echoes,
                          [len(ids) for ids in checked.prompt_ids], checked.prompt_only, checked.tools),
                media_type="text/event-stream",
            )
        finals = await self._whole(stream, count)
        if checked.prompt_only:
            finals = [P.prompt_only(f) for f in finals]
        choices = tools.choices(P.choices(finals, chat, echoes, self.token_text), checked.tools)
        usage = P.usage(finals, [len(ids) for ids in checked.prompt_ids])
        return P.completion_response(rid, self.model, choices, usage, P.speculation_metrics(finals), chat)

    async def _whole(self, stream, count: int) -> list[dict]:
        """Each choice's whole output, assembled from the request's step deltas."""
        wholes = [OutputAssembly() for _ in range(count)]
        try:
            async for delta in stream:
                if REFUSED in delta or delta.get("finish_reason") == "error":
                    raise _error_status(delta)
                wholes[delta["index"]].add(delta)
        except HTTPError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP status
            raise self._failure(e) from None
        return [w.whole for w in wholes]

    def _failure(self, exc) -> HTTPError:
        """What a broken request stream answers: the server ended it (draining), or its cause."""
        if self._expired:
            return HTTPError(503, "the server shut down before this request finished", SHUTTING_DOWN)
        return _error_status(exc)

    async def _first_item(self, stream) -> dict:
        """Wait for the request's first output (after its admission), so that a refusal or an
        error becomes a status code, not a broken stream."""
        try:
            first = await stream.__anext__()
        except Exception as e:  # noqa: BLE001
            stream.cancel()
            self._streams.discard(stream)
            raise self._failure(e) from None
        if REFUSED in first:
            stream.cancel()
            self._streams.discard(stream)
            raise _error_status(first)
        return first

    async def _sse(self, rid, stream, count, first, chat, max_stop, options: P.StreamOptions, echoes, prompt_sizes,
                   prompt_only=False, tool_plan=None):
        # With include_speculation each choice's steps travel with the text they make up.
        tracks = [SpeculationTrack(self.tokenizer) for _ in range(count)] if options.include_speculation else None
        # continuous_usage_stats (vLLM's): every chunk carries its choice's usage so far.
        per_prompt = count // len(prompt_sizes)

        def running(index=None, out=None) -> dict | None:
            if not options.continuous_usage_stats:
                return None
            return P.usage([], prompt_sizes) if out is None else P.usage([out], [prompt_sizes[index // per_prompt]])
        wholes = [OutputAssembly() for _ in range(count)]  # each choice's output so far, from its deltas
        calls = [tool_plan.stream() for _ in range(count)] if tool_plan is not None else None  # tool-call deltas

        async def deltas():
            yield first
            try:
                async for out in stream:
                    yield out
            except Exception as e:  # noqa: BLE001 - the stream broke: an error event
                yield e

        items = deltas()
        sent = [0] * count
        scored = [0] * count  # tokens whose log-probabilities were sent, per choice
        finals: list = [None] * count
        echoes = echoes or [None] * count
        try:
            if chat:
                roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(count)]
                yield P.sse(P.chunk(rid, self.model, roles, chat, usage=running()))
            while any(f is None for f in finals):
                delta = await anext(items, None)
                if delta is None:  # the stream ended early (its replica went away)
                    delta = RuntimeError("the request's stream ended before its choices finished")
                if isinstance(delta, Exception) or REFUSED in delta or delta.get("finish_reason") == "error":
                    err = self._failure(delta) if isinstance(delta, Exception) else _error_status(delta)
                    yield P.sse(P.error_body(err.message, err.kind, err.status))
                    return
                index = delta["index"]
                out = wholes[index].add(delta)
                if prompt_only:
                    out = P.prompt_only(out)
                text, steps = out["text"], None
                if tracks is not None:
                    upto, steps = tracks[index].advance(out, sent[index], max_stop)
                else:  # hold back a possible stop-string prefix until it is decided
                    upto = len(text) if out["finished"] or not max_stop else max(sent[index], len(text) - max_stop + 1)
                delta = text[sent[index]:upto]
                echoing = echoes[index] is not None and sent[index] == 0 and (delta or out["finished"])
                if echoing:
                    delta = echoes[index].text + delta  # echo: the prompt (and its scores) lead the first text
                sent[index] = upto
                reason = P.finish_reason(out["finish_reason"]) if out["finished"] else None
                logprobs = None
                if out.get("logprobs") is not None and (delta or reason) and (len(out["logprobs"]) > scored[index]
                                                                               or echoing):
                    logprobs = P.choice_logprobs(out, chat, echoes[index], self.token_text, scored[index])
                    scored[index] = len(out["logprobs"])
                if calls is None:
                    bodies = [{"content": delta}] if delta or reason or steps else []
                else:  # the text as content and tool-call deltas (protocol/tool_parsers.py)
                    bodies = calls[index].feed(text[:upto], out["finished"])
                    reason = tools.finish_reason(reason, calls[index].called)
                    bodies = bodies or ([{}] if reason or steps else [])
                for n, body in enumerate(bodies):
                    choice = P.delta_choice(index, body, reason if n == len(bodies) - 1 else None, chat)
                    choice["logprobs"] = logprobs if n == 0 else None
                    if steps is not None and n == 0:
                        choice["speculation"] = steps
                    yield P.sse(P.chunk(rid, self.model, [choice], chat, usage=running(index, out)))
                if out["finished"]:
                    finals[index] = out
            if options.include_usage:
                yield P.sse(P.chunk(rid, self.model, [], chat, usage=P.usage(finals, prompt_sizes)))
            yield "data: [DONE]\n\n"
        finally:  # also on client disconnect: cancelling the stream frees the sequences
            stream.cancel()
            self._streams.discard(stream)
