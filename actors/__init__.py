"""Ray actors: thin owners of a device and a piece of state that call the engine core.

TargetWorker (target runner + KV cache), DraftWorker (draft proposer + its cache),
NgramPool (prompt-lookup indices), EngineWorker (colocated: a whole LLMEngine), and the
Coordinator that runs verify/accept with continuous batching.
"""
