"""OpenAI's request and response shapes and the one check of a request, shared by the HTTP
server (``serve/``) and batch files (``entrypoints/jobs.py``): ``openai.py`` (the pydantic
models, response bodies) and ``checks.py`` (a request checked whole against the model, made
into the engine's request records)."""
